"""The figures end-to-end cases measure, one line each, for the run's
summary (conftest prints them and appends them to $KVLEASE_E2E_FIGURES)."""

FIGURES: list[str] = []


def figure(text: str) -> None:
    FIGURES.append(text)
