"""`tandem bench serve` against a real `tandem serve`."""

from __future__ import annotations

import base64
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import DEFAULT_SERVER

from tandem.cli import main


@pytest.mark.slow
def test_bench_serve_against_tandem(tmp_path: Path, capsys: pytest.CaptureFixture[str], shared_server) -> None:  # noqa: ANN001
    """Against the session's default server (the shipped defaults)."""
    server = shared_server(*DEFAULT_SERVER)
    common = ["--base-url", server.url, "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
              "--ignore-eos", "--random-input-len", "32", "--random-output-len", "8"]
    assert main(["bench", "serve", *common, "--num-prompts", "8", "--result-filename", "cmpl.json",
                 "--goodput", "ttft:60000", "--num-warmups", "1", "--report", str(tmp_path / "cmpl.html")]) == 0
    assert main(["bench", "serve", *common, "--backend", "openai-chat", "--num-prompts", "4",
                 "--max-concurrency", "2", "--result-filename", "chat.json"]) == 0
    assert main(["bench", "compare", str(tmp_path / "cmpl.json"), str(tmp_path / "chat.json"),
                 "--report", str(tmp_path / "both.html")]) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out

    r = json.loads((tmp_path / "cmpl.json").read_text())
    assert r["completed"] == 8 and r["failed"] == 0
    assert r["model_id"] and r["endpoint"] == "/v1/completions"
    # The prompts were built as 32 tokens of the server's own tokenizer; ignore_eos makes 8 outputs each.
    assert r["total_input_tokens"] == 8 * 32 and r["total_output_tokens"] == 8 * 8
    assert r["request_throughput"] > 0 and r["output_throughput"] > 0 and r["total_token_throughput"] > 0
    assert 0 < r["mean_ttft_ms"] <= r["p99_ttft_ms"] and r["mean_tpot_ms"] > 0 and r["mean_itl_ms"] > 0
    assert r["mean_e2el_ms"] > r["mean_ttft_ms"]
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # a 60 s TTFT SLO: all meet it

    c = json.loads((tmp_path / "chat.json").read_text())
    assert c["completed"] == 4 and c["total_output_tokens"] == 4 * 8 and c["max_concurrent_requests"] <= 2
    assert c["mean_ttft_ms"] > 0

    # The HTML reports: self-contained, the result's own numbers, and plots that are real PNGs.
    one = Page.parse(tmp_path / "cmpl.html")
    assert one.cells[("seed", "value")] == str(r["seed"])
    assert one.cells[("output_throughput", "value")] == f"{r['output_throughput']:,.2f}"
    assert one.cells[("p99_ttft_ms", "value")] == f"{r['p99_ttft_ms']:,.2f}"
    assert len(one.images) == 3
    both = Page.parse(tmp_path / "both.html")
    assert both.cells[("total_output_tokens", "/ cmpl")] == f"{(4 * 8) / (8 * 8):.2f}x"
    assert len(both.images) == 1  # the two runs' CDFs on one figure, from the records saved beside them


class Page(HTMLParser):
    """The tables (row header, column header) -> cell text and the embedded images of a report."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: dict[tuple[str, str], str] = {}
        self.images: list[bytes] = []
        self._header: list[str] = []
        self._row: list[str] = []
        self._text: list[str] | None = None
        self._th = False

    @classmethod
    def parse(cls, path: Path) -> Page:
        page = cls()
        text = path.read_text()
        # Nothing to fetch: no script, no stylesheet or image by address (the base_url setting is text).
        assert "<script" not in text and "<link" not in text and not re.search(r'(src|href)="(?!data:)', text)
        page.feed(text)
        return page

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("th", "td"):
            self._text = []
            self._th = tag == "th"
        elif tag == "tr":
            self._row = []
        elif tag == "img":
            src = dict(attrs)["src"] or ""
            assert src.startswith("data:image/png;base64,")
            data = base64.b64decode(src.split(",", 1)[1])
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
            self.images.append(data)

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("th", "td") and self._text is not None:
            self._row.append("".join(self._text))
            self._text = None
        elif tag == "tr":
            if self._th:  # a table's header row
                self._header = self._row
            else:
                for col, cell in zip(self._header[1:], self._row[1:], strict=False):
                    self.cells[(self._row[0], col)] = cell
