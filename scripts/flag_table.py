#!/usr/bin/env python
"""Write docs/serving.md's engine flag table from the settings' declarations (tandem/config.py's
flag(...) fields): run it after adding or changing an engine flag; tests/test_engine_args.py fails
while the page and the declarations differ."""

from __future__ import annotations

from pathlib import Path

from tandem.engine.args import with_flag_table

PAGE = Path(__file__).resolve().parent.parent / "docs" / "serving.md"

if __name__ == "__main__":
    PAGE.write_text(with_flag_table(PAGE.read_text()))
    print(f"wrote {PAGE}")
