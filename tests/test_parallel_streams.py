"""The suite's parallel streams (tests/parallel_streams.py): each a one-core machine, and a whole-machine
test alone on every core. Meaningful only when the suite runs in streams (`scripts/test` on more than
one core); a serial run skips them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from parallel_streams import ALL_CORES, WORKER

pytestmark = pytest.mark.skipif(WORKER is None, reason="the suite runs serially (one stream)")


def test_a_stream_and_what_it_starts_have_one_core_and_one_thread() -> None:
    assert len(os.sched_getaffinity(0)) == 1 and torch.get_num_threads() == 1
    # A child inherits the core: `tandem serve` and its workers size themselves to it.
    code = "import os, torch; print(len(os.sched_getaffinity(0)), torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "1"]


@pytest.mark.whole_machine
def test_a_whole_machine_test_has_every_core() -> None:
    assert sorted(os.sched_getaffinity(0)) == ALL_CORES and torch.get_num_threads() == len(ALL_CORES)
