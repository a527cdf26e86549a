#!/usr/bin/env python3
"""Checks every relative markdown link (and its #anchor) in README.md and
docs/*.md, and that every backticked repository path they mention exists.
Run from anywhere: python3 .ci/doc-links.py [repo root]. Not part of .ci/run
(which needs no Python); run it after editing the docs."""
import os, re, sys, glob
root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
os.chdir(root)
files = ["README.md"] + sorted(glob.glob("docs/*.md"))

def slug(h):
    h = h.strip().lower()
    h = re.sub(r"[`*_]", "", h)          # formatting
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h)
    h = re.sub(r"[^\w\- ]", "", h)       # punctuation (keeps letters, digits, _, -, space)
    return h.replace(" ", "-")

def anchors(path):
    out, seen, fence = set(), {}, False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        m = re.match(r"^(#{1,6})\s+(.*)", line)
        if m:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out

bad = 0
links = 0
paths = 0
for f in files:
    text = open(f, encoding="utf-8").read()
    # strip fenced code blocks for link scanning
    body = re.sub(r"```.*?```", "", text, flags=re.S)
    for m in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)\)", body):
        target = m.group(1)
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        links += 1
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(f), path)) if path else f
        if not os.path.exists(dest):
            print(f"{f}: broken link {target} -> {dest}"); bad += 1; continue
        if anchor:
            if not dest.endswith(".md"):
                print(f"{f}: anchor on non-markdown {target}"); bad += 1; continue
            if anchor not in anchors(dest):
                print(f"{f}: missing anchor #{anchor} in {dest}"); bad += 1
    # backticked repository paths
    for m in re.finditer(r"`((?:src|tests|cli|benches|model|fuzz|examples|loom_tests|docs|data|\.ci)/[^`\s*:]*)`", body):
        p = m.group(1).rstrip(".,")
        if "*" in p or "<" in p:
            continue
        paths += 1
        if not os.path.exists(p):
            print(f"{f}: path `{p}` does not exist"); bad += 1
print(f"{links} relative links, {paths} repository paths checked in {len(files)} files; {bad} problems")
sys.exit(1 if bad else 0)
