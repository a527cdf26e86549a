"""The log lines docs/vllm.md quotes are the lines the plugin writes
(issue 28, finding 7: the expiry line operators were told to grep for was not
the one P logged).

Every backquoted line of the "Logs and metrics" table that starts with
``kvlease:`` must match the format string of an info, warning or error line of
``kvlease.vllm``'s source, with the doc's ``<placeholders>`` standing for the
source's ``%s``/``%d`` fields; and every such format must be in the table, so
a new line cannot go undocumented.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "vllm.md"
PLUGIN = REPO / "py" / "python" / "kvlease" / "vllm"


def doc_lines() -> list[str]:
    text = DOC.read_text()
    table = text.split("## Logs and metrics", 1)[1].split("\nCounters", 1)[0]
    return [m for m in re.findall(r"`(kvlease: [^`]+)`", table)]


LEVELS = {"info", "warning", "error", "exception"}


def logged_formats() -> list[str]:
    """The format strings of every info, warning and error line the plugin
    writes (``logger.warning("kvlease: ...", ...)`` and its rate-limited
    ``self._kvl_log.error(kind, "kvlease: ...", ...)``)."""
    out = []
    for path in sorted(PLUGIN.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LEVELS):
                continue
            for arg in node.args[:2]:
                if (isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                        and arg.value.startswith("kvlease: ")):
                    out.append(arg.value)
    return out


def as_pattern(doc_line: str) -> re.Pattern:
    parts = re.split(r"<[^>]*>|\.\.\.", doc_line)
    return re.compile(".*?".join(re.escape(p) for p in parts), re.S)


def test_every_documented_line_is_one_the_plugin_writes():
    strings = logged_formats()
    missing = [line for line in doc_lines()
               if not any(as_pattern(line).fullmatch(s) for s in strings)]
    assert not missing, f"docs/vllm.md quotes log lines the plugin never writes: {missing}"


def test_every_warning_the_plugin_writes_is_documented():
    documented = [as_pattern(line) for line in doc_lines()]
    undocumented = [s for s in logged_formats() if not any(p.fullmatch(s) for p in documented)]
    assert not undocumented, f"log lines missing from docs/vllm.md's table: {undocumented}"
