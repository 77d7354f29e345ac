"""Structured outputs: every output parses as its constraint (JSON schemas with nested objects,
enums, arrays and patterns; regexes; choices) over many seeds; unconstrained requests in the same
batch are unchanged; the API takes OpenAI's response_format and vLLM's structured_outputs / guided_*
fields and refuses a constraint that does not compile with a 400; strict closes a schema's objects,
JSON is compact unless asked otherwise, and a strict reply is its object or says finish_reason length."""

from __future__ import annotations

import asyncio
import json
import math
import re
from types import SimpleNamespace

import httpx
import jsonschema
import pytest
from conftest import DEFAULT_SERVER, FP32_1P1D, FP32_SERVER
from server_utils import web

from tandem import SamplingParams
from tandem.sampling_params import StructuredOutputs

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "city": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                  "country": {"enum": ["FR", "DE", "JP"]}},
                 "required": ["name", "country"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "maxItems": 3}},
     "required": ["city", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
]
PROMPT = [{"role": "user", "content": "Answer in JSON about a city you like."}]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "nested", "array"])
def test_every_sample_validates_against_its_schema(llm_fp32, schema: dict) -> None:  # noqa: ANN001
    so = StructuredOutputs("json", json.dumps(schema))
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=120, structured=so) for seed in range(8)]
    for out in llm_fp32.chat([PROMPT] * len(params), params):
        text, reason = out.outputs[0].text, out.outputs[0].finish_reason
        assert reason == "stop", (text, reason)  # the grammar finished: the model had to say EOS
        jsonschema.validate(json.loads(text), schema)


def test_regexes_and_choices_match_and_free_requests_are_unchanged(llm_fp32) -> None:  # noqa: ANN001
    prompts = ["My phone number is", "The capital of France is", "Once upon a time"]
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = [o.outputs[0].text for o in llm_fp32.generate(prompts, free)]
    regex = StructuredOutputs("regex", r"\d{3}-\d{4}")
    choice = StructuredOutputs("choice", json.dumps(["Paris", "Lyon", "Nice"]))
    mixed = llm_fp32.generate(prompts * 2, [free] * 3 + [
        SamplingParams(temperature=0, max_tokens=12, structured=regex),
        SamplingParams(temperature=0, max_tokens=12, structured=choice),
        SamplingParams(temperature=0.8, seed=3, max_tokens=200, structured=StructuredOutputs("json_object"))])
    assert [o.outputs[0].text for o in mixed[:3]] == alone  # the constrained rows left the others alone
    assert re.fullmatch(r"\d{3}-\d{4}", mixed[3].outputs[0].text)
    assert mixed[4].outputs[0].text in ("Paris", "Lyon", "Nice")
    out = mixed[5].outputs[0]
    # Sampled and compact: an object, or cut at max_tokens and saying so (this seed writes long keys).
    assert out.text.startswith("{") and "\n" not in out.text, out.text
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 200, out.finish_reason


def test_logprobs_under_a_grammar_are_the_models_own(llm_fp32) -> None:  # noqa: ANN001
    """A constrained request's logprobs are the model's distribution's, as without a grammar (they were
    the masked distribution's: -inf for what the grammar forbids, which JSON cannot carry, so the API
    answered 500): each sampled token's logprob and top tokens equal the same tokens scored as a prompt
    without a grammar, though the grammar chose a token the model would not have."""
    choice = StructuredOutputs("choice", json.dumps(["Lyon", "Nice"]))
    out = llm_fp32.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8, logprobs=3,
                                                                        structured=choice))[0]
    sampled = out.outputs[0]
    assert sampled.text in ("Lyon", "Nice")
    ids = out.prompt_token_ids + sampled.token_ids
    scored = llm_fp32.generate(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))[0].prompt_logprobs
    for i, (token, entry) in enumerate(zip(sampled.token_ids, sampled.logprobs, strict=True)):
        want = scored[len(out.prompt_token_ids) + i]
        assert math.isfinite(entry[token].logprob)
        assert entry[token].logprob == pytest.approx(want[token].logprob, abs=1e-4)
        assert sorted(t for t, e in entry.items() if e.rank <= 3) == sorted(t for t, e in want.items() if e.rank <= 3)
    assert max(entry[t].rank for t, entry in zip(sampled.token_ids, sampled.logprobs, strict=True)) > 1


def test_the_api_takes_response_format_and_refuses_what_does_not_compile(shared_server) -> None:  # noqa: ANN001
    schema = SCHEMAS[0]
    server = shared_server(*DEFAULT_SERVER)
    def chat(**fields: object) -> httpx.Response:
        return web.post(f"{server.url}/v1/chat/completions", timeout=120,
                        json={"messages": PROMPT, "max_tokens": 80, "temperature": 0.7, "seed": 1, **fields})

    r = chat(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema,
                                                                       "strict": True}})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), schema)
    assert json.dumps(json.loads(content)) == content  # compact, as json.dumps writes it
    r = chat(max_tokens=4, response_format={"type": "json_object"})
    assert r.json()["choices"][0]["finish_reason"] == "length", r.text  # cut: not an object, and says so
    r = chat(structured_outputs={"choice": ["yes", "no"]}, logprobs=True, top_logprobs=3)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")
    assert all(-9999 <= t["logprob"] <= 0 for t in r.json()["choices"][0]["logprobs"]["content"])
    r = chat(guided_regex="[0-9]{4}", stream=True)
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                   for line in r.text.splitlines() if line.startswith("data: {") and '"choices": [{' in line)
    assert re.fullmatch("[0-9]{4}", text), text
    for fields, param in (({"guided_regex": "[a-z"}, "response_format"),
                          ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
                          ({"response_format": {"type": "json_schema"}}, "response_format")):
        r = chat(**fields)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert web.get(f"{server.url}/health").status_code == 200


def test_request_fields_and_the_server_default_set_strict_and_whitespace(llm_fp32) -> None:  # noqa: ANN001
    from tandem.serve.prepare import GrammarCheck
    from tandem.serve.protocol import ChatCompletionRequest

    def structured(**fields: object) -> StructuredOutputs | None:
        return ChatCompletionRequest(messages=PROMPT, **fields).structured()

    spec = json.dumps(OPEN_SCHEMAS[0])
    strict = {"type": "json_schema", "json_schema": {"schema": OPEN_SCHEMAS[0], "strict": True}}
    assert structured(response_format=strict) == StructuredOutputs("json", spec, strict=True)
    assert structured(response_format={"type": "json_schema", "json_schema": {"schema": OPEN_SCHEMAS[0]}}) == \
        StructuredOutputs("json", spec)
    assert structured(guided_json=OPEN_SCHEMAS[0], structured_outputs={
        "disable_any_whitespace": False, "disable_additional_properties": True}) == \
        StructuredOutputs("json", spec, strict=True, whitespace_flexible=True)
    assert structured(response_format={"type": "json_object"}, structured_outputs={"disable_any_whitespace": True}) \
        == StructuredOutputs("json_object", whitespace_flexible=False)
    assert structured(structured_outputs={"regex": "a+", "disable_any_whitespace": False}) == \
        StructuredOutputs("regex", "a+")  # JSON's options: nothing to a regex

    engine = SimpleNamespace(info=SimpleNamespace(vocab_size=49152))  # what GrammarCheck reads of it
    for server_flexible in (False, True):  # --structured-outputs-whitespace compact | flexible
        check = GrammarCheck(llm_fp32.get_tokenizer(), engine, server_flexible)  # type: ignore[arg-type]
        for asked, given in ((None, server_flexible), (True, True), (False, False)):
            params = SamplingParams(structured=StructuredOutputs("json_object", whitespace_flexible=asked))
            asyncio.run(check.check(params))
            assert params.structured is not None and params.structured.whitespace_flexible is given


@pytest.mark.slow
def test_a_disaggregated_deployment_constrains_the_prefill_and_the_decode_side(shared_server) -> None:  # noqa: ANN001
    """The prefill worker samples the first token under the mask; the decode worker's matcher is fed
    that token and constrains the rest (the session's 1P1D deployment: constrained requests get no drafts): the
    outputs equal the colocated server's."""
    fields = [{"guided_regex": r"[A-Z][a-z]{2,8} [0-9]{2}"}, {"guided_choice": ["alpha", "beta", "gamma"]},
              {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMAS[0]}}}]

    def run(url: str) -> list[str]:
        return [web.post(f"{url}/v1/chat/completions", timeout=120,
                         json={"messages": PROMPT, "max_tokens": 60, "temperature": 0, **f}
                         ).json()["choices"][0]["message"]["content"] for f in fields]

    expected = run(shared_server(*FP32_SERVER).url)
    assert run(shared_server(*FP32_1P1D).url) == expected
    assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{2}", expected[0]) and expected[1] in ("alpha", "beta", "gamma")
    jsonschema.validate(json.loads(expected[2]), SCHEMAS[0])


# Small objects that do not say additionalProperties (issue #33's held-out requests did not).
OPEN_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                      "population": {"type": "integer"}}, "required": ["city", "country"]},
    {"type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "object", "properties": {
        "last": {"type": "string"}}, "required": ["last"]}}, "required": ["title", "author"]},
]


def test_strict_closes_every_object_and_keeps_what_the_schema_says() -> None:
    from tandem.engine.grammars import COMPACT, closed_objects, json_schema_of

    item = {"type": "object", "properties": {"x": {"type": "number"}}}
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}},
        "kept": {"type": "object", "additionalProperties": {"type": "integer"}},
        "list": {"type": "array", "items": item}, "pair": {"prefixItems": [item, {"type": "string"}]},
        "either": {"anyOf": [item, {"$ref": "#/$defs/d"}]},
        "both": {"allOf": [{"properties": {"p": {}}}, {"properties": {"q": {"properties": {"r": {}}}}}]}},
        "$defs": {"d": {"properties": {"e": {}}, "required": ["e"]}}, "additionalProperties": True}
    closed = closed_objects(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is True  # said: kept
    assert props["a"]["additionalProperties"] is False
    assert props["kept"]["additionalProperties"] == {"type": "integer"}
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["pair"]["prefixItems"][0]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False  # no type, but properties: an object
    # allOf's branches make one object together: they stay open, what is nested in them is closed
    both = props["both"]
    assert "additionalProperties" not in both and "additionalProperties" not in both["allOf"][0]
    assert both["allOf"][1]["properties"]["q"]["additionalProperties"] is False
    assert "additionalProperties" not in schema["properties"]["a"]  # the request's schema is not changed
    jsonschema.Draft202012Validator.check_schema(closed)

    text = json.dumps(schema)
    assert json_schema_of(StructuredOutputs("json", text)) == COMPACT | schema  # not strict: only compact
    assert json_schema_of(StructuredOutputs("json", text, strict=True)) == COMPACT | closed
    assert json_schema_of(StructuredOutputs("json", text, whitespace_flexible=True)) == schema
    # json_object names no properties: closed, it could only be {}
    assert json_schema_of(StructuredOutputs("json_object", strict=True, whitespace_flexible=True)) == \
        {"type": "object"}
    own = {"type": "object", "x-guidance": {"whitespace_flexible": True}}
    assert json_schema_of(StructuredOutputs("json", json.dumps(own))) == own  # the schema's own spacing wins


KIND = {"type": "object", "properties": {"kind": {"type": "string"}}}
# Schemas whose combinators refine their object: strict must not change what they accept.
REFINED = [
    KIND | {"anyOf": [{"properties": {"kind": {"const": "a"}}}, {"required": ["x"]}]},
    KIND | {"oneOf": [{"properties": {"kind": {"const": "a"}}, "required": ["kind"]}, {"required": ["x"]}]},
    KIND | {"allOf": [{"properties": {"x": {"type": "integer"}}}, {"required": ["kind"]}]},
    KIND | {"if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["x"]},
            "else": {"properties": {"y": {"type": "integer"}}}},
    KIND | {"additionalProperties": True, "not": {"properties": {"kind": {"const": "b"}}, "required": ["kind"]}},
    KIND | {"dependentSchemas": {"kind": {"properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
    {"required": ["x"]},  # closed, an object that requires what it does not name would take nothing
    {"type": "object", "additionalProperties": True, "properties": {"p": {
        "type": "object", "required": ["x"], "not": {"properties": {"x": {"type": "object", "properties": {}}}}}}},
]
INSTANCES = [{}, {"kind": "a"}, {"kind": "b"}, {"x": 1}, {"kind": "a", "x": 1}, {"kind": "b", "x": 1},
             {"kind": "a", "y": 2}, {"kind": "b", "y": 2}, {"kind": "b", "x": "s"}, {"kind": "a", "x": 1, "z": 3},
             {"p": {"x": 1}}, {"p": {"x": {"w": 1}}}, {"p": {}}, 5, None]


@pytest.mark.parametrize("schema", REFINED)
def test_strict_keeps_what_combinators_mean(schema: dict) -> None:
    """A branch of anyOf, oneOf, allOf, if/then/else or dependentSchemas constrains its parent's
    object, and `not` and `if` turn what they hold around: closing any of them (or a parent whose
    branches name other properties) would refuse objects the schema takes."""
    from tandem.engine.grammars import closed_objects

    original = jsonschema.Draft202012Validator(schema)
    closed = jsonschema.Draft202012Validator(closed_objects(schema))
    assert [original.is_valid(i) for i in INSTANCES] == [closed.is_valid(i) for i in INSTANCES]
    # and the instances tell: each schema takes one with a property its object does not name
    assert any(isinstance(i, dict) and set(i) - {"kind"} and original.is_valid(i) for i in INSTANCES)
    if schema is REFINED[0]:
        assert closed.is_valid({"kind": "a", "x": 1})  # refused, when strict closed the anyOf's branches


def test_strict_still_closes_objects_and_the_branches_of_a_plain_union() -> None:
    from tandem.engine.grammars import closed_objects

    item = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for schema, extra in (
            (item, {"a": 1, "b": 2}),
            (KIND | {"properties": {"inner": item}, "anyOf": [{"required": ["kind"]}, {"required": ["inner"]}]},
             {"inner": {"a": 1, "b": 2}}),  # the parent stays open; what its properties hold is closed
            ({"anyOf": [item, {"type": "null"}]}, {"a": 1, "b": 2}),  # a union's branch is the whole value
            ({"oneOf": [item, {"type": "array", "items": item}]}, [{"a": 1, "b": 2}]),
            ({"allOf": [{"properties": {"o": item}}]}, {"o": {"a": 1, "b": 2}}),
            ({"if": {"type": "object"}, "then": {"properties": {"o": item}}}, {"o": {"a": 1, "b": 2}})):
        fitting = json.loads(json.dumps(extra).replace(', "b": 2', ""))
        original = jsonschema.Draft202012Validator(schema)
        closed = jsonschema.Draft202012Validator(closed_objects(schema))
        assert original.is_valid(extra) and original.is_valid(fitting) and closed.is_valid(fitting), schema
        assert not closed.is_valid(extra), schema


def test_compact_json_has_no_free_whitespace_and_flexible_is_llguidances_default(llm_fp32) -> None:  # noqa: ANN001
    import llguidance

    from tandem.engine.grammars import Grammars, grammar_of

    tokenizer = llm_fp32.get_tokenizer()
    grammars = Grammars(tokenizer, 49152)
    spec = json.dumps(OPEN_SCHEMAS[2])

    def takes(so: StructuredOutputs, text: str) -> bool:
        m = grammars.matcher(so)
        return all(m.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and \
            m.is_accepting()

    written = '{"title": "Dune", "author": {"last": "Herbert"}}'
    spaced = '{\n  "title": "Dune",\n  "author": {"last":"Herbert"}\n}'
    extra = '{"title": "Dune", "author": {"last": "Herbert", "first": "Frank"}}'
    for so in (StructuredOutputs("json", spec), StructuredOutputs("json", spec, strict=True)):
        assert takes(so, written) and not takes(so, spaced)
    assert takes(StructuredOutputs("json", spec), extra) and not takes(StructuredOutputs("json", spec, strict=True),
                                                                      extra)
    flexible = StructuredOutputs("json", spec, whitespace_flexible=True)
    assert grammar_of(flexible) == llguidance.grammar_from("json_schema", spec)
    assert takes(flexible, written) and takes(flexible, spaced)
    assert takes(StructuredOutputs("json_object"), written) and not takes(StructuredOutputs("json_object"), spaced)


def test_strict_schemas_at_temperature_finish_as_valid_objects_or_say_length(llm_fp32) -> None:  # noqa: ANN001
    """Issue #33: strict, at temperature 0.8 and max_tokens 120, the replies had invented properties and
    newlines between every token until max_tokens ran out. Each reply is now its closed schema's object,
    written compactly, or is cut by max_tokens and says so."""
    from tandem.engine.grammars import closed_objects

    cases = [(s, seed) for s in OPEN_SCHEMAS for seed in range(12)]
    params = [SamplingParams(temperature=0.8, seed=seed, max_tokens=120,
                             structured=StructuredOutputs("json", json.dumps(s), strict=True)) for s, seed in cases]
    outs = llm_fp32.chat([[{"role": "user", "content": "Answer in JSON."}]] * len(cases), params)
    reasons = []
    for (schema, _), out in zip(cases, outs, strict=True):
        text, reason = out.outputs[0].text, out.outputs[0].finish_reason
        assert "\n" not in text, text
        if reason == "length":
            assert len(out.outputs[0].token_ids) == 120
        else:
            assert reason == "stop", (text, reason)
            jsonschema.validate(json.loads(text), closed_objects(schema))
        reasons.append(reason)
    # Most finish. A long string may not, nor a number: closed, an object whose properties are all
    # written allows only "}" where this model wants a "," and more properties, so digits can win.
    assert reasons.count("stop") >= len(cases) // 2, reasons


def test_the_mask_is_llguidances_own_bit_for_bit(llm_fp32) -> None:  # noqa: ANN001
    """The mask is unpacked with numpy (llguidance.torch's CPU apply is ~50x slower here): the result
    must be what llguidance's apply gives, on a row with many allowed tokens and few, in a batch with
    free rows and alone."""
    import llguidance.torch as llt
    import torch

    from tandem.engine.grammars import Grammars
    from tandem.engine.structured import apply_masks, disallowed_tokens

    grammars = Grammars(llm_fp32.get_tokenizer(), 49152)
    for so in (StructuredOutputs("json_object"), StructuredOutputs("regex", "[a-z ]+"),
               StructuredOutputs("choice", json.dumps(["yes", "no"]))):
        mask = llt.allocate_token_bitmask(1, 49152)
        llt.fill_next_token_bitmask(grammars.matcher(so), mask, 0)
        ours = torch.randn(3, 49152, dtype=torch.bfloat16)
        theirs = ours.clone()
        llt.apply_token_bitmask_inplace(theirs[1:2], mask)
        apply_masks(ours, ([1], disallowed_tokens(mask.numpy(), 49152)))
        assert torch.equal(ours, theirs) and torch.isfinite(ours[1]).sum() > 0
        alone = theirs[1:2].clone()
        assert torch.equal(apply_masks(alone, ([0], disallowed_tokens(mask.numpy(), 49152))), theirs[1:2])
