"""The int8-activation kernel of two commits side by side in one process (issue #46): each commit's
`tandem/ops/quant_linear_q8.cpp` (with the K-quant files and headers it includes, as that commit has
them) is built under an op namespace of its own (`tandem_<name>`), and the calls alternate, round by
round, on the same weights and rows; each gets its best of the rounds. On a VM whose speed moves by
a quarter within minutes, runs in separate processes one after the other cannot separate a 10%
change from the noise; calls interleaved in one process can.

    .venv/bin/python benchmarks/int8_kernel_ab.py --base 220a6f8                # against the work tree
    .venv/bin/python benchmarks/int8_kernel_ab.py --base 220a6f8 --new HEAD --formats Q4_0 --rows 1,256

Layers: Llama-3.2-1B's gate_up (16384 x 2048) and down (2048 x 8192), random blocks with valid scales.
Up to 8 rows, copies of the weight are cycled (384 MiB in all) so each call reads it from memory, and
the rate is weight bytes per second; past 8 rows one copy (a prompt's compute sets the time), in
G multiply-adds per second. Results: benchmarks/results/int8_kernel_ab.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from quant_gemv import fmt_named, random_blocks
from rich.console import Console
from rich.table import Table
from torch.utils.cpp_extension import load

from tandem.ops import extension

console = Console(stderr=True, width=140)
ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results" / "int8_kernel_ab.json"
SOURCES = ["quant_linear_q8.cpp", "quant_linear_k8.cpp", "quant_linear_k8_panel.cpp"]
LAYERS = {"gate_up": (16384, 2048), "down": (2048, 8192)}
CYCLED_BYTES = 384 << 20


def source_of(rev: str, name: str) -> str:
    """tandem/ops/<name> at a commit, or in the work tree for rev "."."""
    if rev == ".":
        return (ROOT / "tandem" / "ops" / name).read_text()
    return subprocess.run(["git", "show", f"{rev}:tandem/ops/{name}"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def build(rev: str, name: str, workdir: Path) -> object:
    """The commit's int8 kernel as torch.ops.tandem_<name>.gguf_linear_q8."""
    src = workdir / name
    src.mkdir()
    headers = subprocess.run(["git", "ls-tree", "--name-only", rev, "tandem/ops/"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split() if rev != "." else \
        [str(p.relative_to(ROOT)) for p in (ROOT / "tandem" / "ops").glob("*.h")]
    for h in (Path(p).name for p in headers if p.endswith(".h")):
        (src / h).write_text(source_of(rev, h))
    for s in SOURCES:
        text = source_of(rev, s).replace("TORCH_LIBRARY_FRAGMENT(tandem,", f"TORCH_LIBRARY_FRAGMENT(tandem_{name},")
        (src / s).write_text(text.replace("TORCH_LIBRARY_IMPL(tandem,", f"TORCH_LIBRARY_IMPL(tandem_{name},"))
    console.print(f"building {name} ({rev}) ...")
    load(name=f"int8_ab_{name}", sources=[str(src / s) for s in SOURCES], extra_cflags=list(extension._CFLAGS),
         extra_ldflags=list(extension._LDFLAGS), build_directory=str(src), is_python_module=False)
    return getattr(torch.ops, f"tandem_{name}").gguf_linear_q8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="a commit")
    ap.add_argument("--new", default=".", help="a commit, or . for the work tree (default)")
    ap.add_argument("--formats", default="Q4_0,Q4_1,Q5_0,Q8_0,MXFP4")
    ap.add_argument("--rows", default="1,4,8,256")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="int8-ab-"))
    try:
        ops = {"base": build(args.base, "base", workdir), "new": build(args.new, "new", workdir)}
        results = []
        for fmt_name in args.formats.split(","):
            fmt = fmt_named(fmt_name)
            for layer, (n, k) in LAYERS.items():
                first = random_blocks(fmt, n, k, 0)
                for rows in (int(r) for r in args.rows.split(",")):
                    memory_bound = rows <= 8
                    weights = [first.clone() for _ in range(max(2, CYCLED_BYTES // first.numel()))] if memory_bound \
                        else [first]
                    x = torch.randn(rows, k)
                    best = dict.fromkeys(ops, float("inf"))
                    for _ in range(args.rounds):
                        for name, op in ops.items():
                            t0 = time.perf_counter()
                            for w in weights:
                                op(x, w, fmt.ggml_type, k, None)
                            best[name] = min(best[name], (time.perf_counter() - t0) / len(weights))
                    rate = {name: (first.numel() if memory_bound else rows * n * k) / s for name, s in best.items()}
                    results.append({"format": fmt_name, "layer": layer, "rows": rows, "seconds": best,
                                    "unit": "bytes/s" if memory_bound else "mac/s", "rate": rate})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    table = Table(title=f"int8 kernel, {args.base} against {args.new}, {torch.get_num_threads()} threads, "
                        f"best of {args.rounds} interleaved rounds")
    for col in ("format", "layer", "rows", "base ms", "new ms", "speed-up", "base rate", "new rate"):
        table.add_column(col, justify="right")
    for r in results:
        unit, scale = ("GB/s", 1e9) if r["unit"] == "bytes/s" else ("G MAC/s", 1e9)
        table.add_row(r["format"], r["layer"], str(r["rows"]), f"{r['seconds']['base'] * 1e3:.3f}",
                      f"{r['seconds']['new'] * 1e3:.3f}", f"{r['seconds']['base'] / r['seconds']['new']:.2f}x",
                      f"{r['rate']['base'] / scale:.1f} {unit}", f"{r['rate']['new'] / scale:.1f} {unit}")
    console.print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                   "isa": extension.extension_isa(), "base": args.base, "new": args.new,
                                   "results": results}, indent=1))


if __name__ == "__main__":
    main()
