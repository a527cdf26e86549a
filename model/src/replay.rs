//! Replays model traces on the real roles.
