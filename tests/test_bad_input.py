"""Bad input gets a clear error and leaves the engine serving."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.model.loader import ModelLoadError

OK = SamplingParams(temperature=0, max_tokens=4)


@pytest.mark.parametrize(("prompt", "params", "message"), [
    ("", OK, "prompt is empty"),
    ([], OK, "prompt is empty"),
    ([1, 2, 10**9], OK, "token ids must be in"),
    ("hello " * 9000, OK, "maximum context length"),
    ("hello", SamplingParams(max_tokens=9000), "maximum context length"),
    ("hello", SamplingParams(max_tokens=4, top_k=10**6), "vocabulary size"),
    ("hello", SamplingParams(max_tokens=4, stop_token_ids=[10**6]), "stop_token_ids"),
    ("hello", SamplingParams(max_tokens=None, min_tokens=10**6), "min_tokens"),
    ("a\ud800b", OK, "lone surrogate"),
    ([1, True], OK, "string or a list of token ids"),
])
def test_bad_prompts_are_rejected_and_engine_keeps_serving(llm_fp32, prompt, params, message) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        llm_fp32.generate([prompt], params)
    out = llm_fp32.generate(["hello"], OK)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_a_bad_prompt_rejects_the_whole_call(llm_fp32) -> None:  # noqa: ANN001
    with pytest.raises(ValueError):
        llm_fp32.generate(["fine", ""], OK)  # nothing from the call may stay queued (checked after the test)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1}, "temperature"),
    ({"n": 0}, "n must"),
    ({"min_p": 2}, "min_p"),
    ({"logprobs": 100}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"temperature": float("nan")}, "temperature must be a finite"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite"),
    ({"top_k": -2}, "top_k"),
    ({"logit_bias": {True: 1}}, "logit_bias keys"),
    ({"logit_bias": {12: True}}, "logit_bias values"),
    ({"logit_bias": {12: "5"}}, "logit_bias values"),
])
def test_bad_sampling_params(kwargs, message) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_missing_model_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope.gguf"))


def test_corrupt_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="not a valid GGUF"):
        LLM(str(bad))
    bad.write_bytes(b"this is not a model at all")
    with pytest.raises(ModelLoadError, match="not a valid GGUF"):
        LLM(str(bad))


def test_truncated_gguf_file(tmp_path: Path, default_model_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(default_model_path.read_bytes()[:5_000_000])
    with pytest.raises(ModelLoadError):
        LLM(str(cut))


def test_bad_model_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not a valid model config"):
        LLM(str(tmp_path))


def test_unknown_engine_option() -> None:
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(not_an_option=1)
