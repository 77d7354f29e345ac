"""`tandem serve`'s flags: the server, admission, disaggregation, routing, SLOs and the planner."""

from __future__ import annotations

import argparse

from tandem.cli.common import add_log_args
from tandem.engine.args import add_engine_args
from tandem.policy.admission import ADMISSION_MODES, AdmissionSettings
from tandem.serve.reasoning import REASONING_FORMATS
from tandem.serve.tool_calls.formats import FORMATS
from tandem.slo import DEFAULT_SLO


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--api-key", action="append", help="required bearer token on /v1/* (repeatable; "
                     "or TANDEM_API_KEY); each key is its own prefix-cache tenant")
    adm = srv.add_argument_group("admission and fairness (429 with Retry-After for what cannot be served in time)")
    adm.add_argument("--admission", default="queue", choices=list(ADMISSION_MODES),
                     help="queue: requests wait for the engine, and one is refused only when it cannot start within "
                     "its own timeout or --max-queue-delay, or the waiting caps are full; slo: admit a request only if "
                     "it is predicted to meet --slo-ttft-ms and --slo-tpot-ms without making a request in flight miss "
                     "its TPOT SLO (from the engine's step times, timed at start-up and followed as it runs); off: "
                     "only the waiting caps")
    adm.add_argument("--max-queue-delay", type=float, default=AdmissionSettings.max_queue_delay_s, metavar="SECONDS",
                     help="queue: refuse a request whose first token is predicted later than this")
    adm.add_argument("--max-waiting-requests", type=int, default=AdmissionSettings.max_waiting_requests,
                     help="requests queued without a first token before new ones get 429")
    adm.add_argument("--seat-overcommit", type=float, default=AdmissionSettings.seat_overcommit,
                     help="slo: requests in flight per engine sequence slot (max-num-seqs); above 1 some wait for "
                     "one, 1 keeps TPOT under overload")
    adm.add_argument("--admission-ttft-budget", type=float, default=0.0, metavar="SECONDS",
                     help="slo: refuse a request whose queued prompt work ahead would delay its first token longer "
                     "(at the measured prompt rate): the TTFT SLO to keep under overload; 0: no limit")
    adm.add_argument("--max-tenant-waiting-requests", type=int, default=None,
                     help="requests one tenant may have waiting for a first token")
    adm.add_argument("--max-tenant-queued-tokens", type=int, default=None,
                     help="prompt tokens one tenant may have waiting")
    adm.add_argument("--tenant-header", default=None,
                     help="name tenants by this request header (e.g. X-Tenant) instead of by API key")
    adm.add_argument("--tenant-weight", action="append", metavar="NAME=WEIGHT",
                     help="a tenant's share of prompt compute against others (NAME: an API key or header value)")
    srv.add_argument("--metrics-require-api-key", action="store_true",
                     help="put /metrics behind the API key too")
    srv.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is aborted")
    srv.add_argument("--graceful-shutdown-timeout", type=int, default=30)
    srv.add_argument("--uvicorn-log-level", default="warning")
    add_log_args(srv)
    srv.add_argument("--kv-events-endpoint", default=None,
                     help="publish prefix-cache block events on this ZeroMQ PUB address (e.g. tcp://127.0.0.1:5557)")
    srv.add_argument("--max-request-body-bytes", type=int, default=8 << 20,
                     help="larger request bodies get 413 (checked before they are read)")
    srv.add_argument("--max-prompt-chars", type=int, default=1_000_000,
                     help="characters of text (all prompts or messages) per request, checked before tokenizing")
    srv.add_argument("--trust-request-chat-template", action="store_true",
                     help="accept a chat_template in chat requests (rendered in a sandbox process with a time "
                     "and a size budget); refused with 400 by default")
    srv.add_argument("--reject-unknown-fields", action="store_true",
                     help="refuse (400) a request with a field the API does not know; by default such a field is "
                     "ignored, as vLLM ignores it, with a warning and an X-Ignored-Fields response header")
    srv.add_argument("--tool-call-parser", default="auto", choices=["auto", *FORMATS],
                     help="how the model writes tool calls; auto: from its chat template (Hermes's <tool_call> "
                     "tags when the template knows no tools, which Tandem then describes in the system prompt)")
    srv.add_argument("--max-stored-responses", type=int, default=1024,
                     help="responses the Responses API keeps for previous_response_id and GET (store: true); "
                     "the least recently used go first")
    srv.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_FORMATS),
                     help="set a reply's reasoning apart from its answer (reasoning_content in chat, thinking "
                     "blocks in Messages): qwen3 (a <think> block at the reply's start) or deepseek_r1 (the "
                     "reply starts in its reasoning, up to </think>); off by default")
    srv.add_argument("--structured-outputs-whitespace", default="compact", choices=["compact", "flexible"],
                     help="whitespace in JSON constraints (json_schema, json_object, guided_json) when a request "
                     "does not set structured_outputs.disable_any_whitespace: compact, as json.dumps writes it, "
                     "or flexible, any between tokens (llguidance's default; a sampled reply can fill max_tokens "
                     "with newlines)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="accepted for vLLM's command lines: tool_choice auto is always on")
    dis = srv.add_argument_group("disaggregation (a router in front of prefill and decode workers)")
    dis.add_argument("--prefill-workers", type=int, default=0, help="prefill workers to start on this host")
    dis.add_argument("--decode-workers", type=int, default=0, help="decode workers to start on this host")
    dis.add_argument("--workers", type=int, default=0,
                     help="colocated (full) workers to start on this host: data parallel behind the router, "
                     "alone or next to prefill/decode workers")
    dis.add_argument("--worker-cores", nargs="+", default=None, metavar="CORES",
                     help="cores of each local worker, prefill workers first, then decode, then colocated "
                     "(e.g. 0 1, or 0-1 2-3); default one core each, round-robin")
    dis.add_argument("--prefill-worker-args", default="", metavar="FLAGS",
                     help="engine flags for prefill workers only, e.g. \"--max-num-batched-tokens 4096\"")
    dis.add_argument("--decode-worker-args", default="", metavar="FLAGS",
                     help="engine flags for decode workers only, e.g. \"--max-num-seqs 256\"")
    dis.add_argument("--kv-transport", default="shm", choices=["shm", "zmq"],
                     help="how local decode workers receive KV: shared memory or ZeroMQ/TCP")
    dis.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                     help="place the workers as Ray actors on the cluster at ADDRESS (default: the one this host "
                     "belongs to), a placement group each; needs the ray extra")
    dis.add_argument("--ray-worker-cpus", type=int, default=1, help="CPUs Ray reserves for each worker")
    dis.add_argument("--router-bind", default=None,
                     help="address workers connect to (e.g. tcp://0.0.0.0:5600 to let other hosts join; "
                     "they need the same $TANDEM_DISAGG_SECRET)")
    dis.add_argument("--worker-heartbeat-timeout", type=float, default=5.0,
                     help="seconds of silence before a worker is declared dead")
    rt = srv.add_argument_group("routing (which worker a request goes to)")
    rt.add_argument("--routing-policy", default="kv", choices=["kv", "least-loaded", "round-robin"],
                    help="kv: the worker where the prompt's prefix is cached, weighed against its load")
    rt.add_argument("--routing-overlap-weight", type=float, default=1.0,
                    help="kv: what one block still to prefill costs, in blocks of decode load")
    rt.add_argument("--routing-temperature", type=float, default=0.0, help="kv: > 0 draws from a softmax of the costs")
    rt.add_argument("--routing-guard-ratio", type=float, default=1.5,
                    help="kv: a worker serving more than this times the mean requests (+1) gets no more")
    rt.add_argument("--path-policy", default="slo", choices=["slo", "disaggregated"],
                    help="slo: per request, the path (colocated on one worker, disaggregated over a prefill/decode "
                    "pair, prefill-free from the KV store) whose predicted TTFT and TPOT meet --slo-ttft-ms and "
                    "--slo-tpot-ms with the most headroom; disaggregated: every prompt through a pair when "
                    "there is one")
    pl = srv.add_argument_group("SLOs and the planner (which moves local workers between prefill and decode)")
    pl.add_argument("--planner", default="off", choices=["on", "off"])
    pl.add_argument("--slo-ttft-ms", type=float, default=DEFAULT_SLO.ttft_s * 1000,
                    help="the SLO on time to first token (p90): admission's deadline, the router's and planner's aim")
    pl.add_argument("--slo-tpot-ms", type=float, default=DEFAULT_SLO.tpot_s * 1000,
                    help="the SLO on time per output token (p90): admission's deadline, the router's and planner's aim")
    pl.add_argument("--planner-interval", type=float, default=5.0, help="seconds between the planner's decisions")
    pl.add_argument("--planner-dwell", type=float, default=120.0, help="seconds after an action before the next")
    pl.add_argument("--planner-window", type=float, default=60.0,
                    help="seconds of finished requests and arrivals the planner judges and forecasts from")
    pl.add_argument("--planner-profile", action="append", default=None, metavar="[ROLE=]PATH",
                    help="a `tandem profile` JSON of a worker's engine: the planner then predicts before it acts, "
                    "scoring each move by the goodput the simulator gives it on the forecast load; ROLE=PATH "
                    "(colocated, prefill, decode) for one role's own (repeatable; a bare PATH is every role's)")
    pl.add_argument("--planner-margin", type=float, default=0.1,
                    help="predictive: a move's predicted goodput must beat staying's by this fraction")
    pl.add_argument("--planner-migration", choices=["on", "off"], default="on",
                    help="a worker the planner retires moves the requests it decodes to other workers, KV and all "
                    "(a live migration), instead of waiting for them to finish")
    pl.add_argument("--planner-cpu-share", type=float, default=0.05,
                    help="predictive: the share of one core the simulator may take (the router shares its "
                    "host's cores with the workers); decisions are spaced to keep within it")
    return srv
