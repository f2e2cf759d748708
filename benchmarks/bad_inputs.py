"""Bad inputs against the three services over real HTTP: every hand-made malformed, oversized,
out-of-range or unauthorized request must get a bounded 4xx (or, where the input is a legal
but hopeless one, a 200 whose status says so), never a 5xx nor a hang.

Topology (real, loopback, one process): the reference engine on a tiny model with a strong
API token and a weights root (`tests/engine_server.py`), the reward service with its
toy and math verifiers plus `code` when bubblewrap works here, and the rollout service with
its scheduler on a real redis-server, generating on that engine and scoring on that reward
service (so a bad input that is accepted by mistake is really run).

Each case is one request; the table shows what was sent (abbreviated), the status, whether
the answer was a clear 4xx (a 4xx whose body carries a message), its size and time, and a
note when the status is not the one expected or a case's own check failed (e.g. every refused
weights path must answer the same generic message). Exit status 1 on any 5xx, timeout (no
answer within `--timeout`), dropped connection or answer over MAX_ANSWER_BYTES; unexpected
statuses are reported, not failed on (a 200 can be a legitimate answer to odd input).

    .venv/bin/python benchmarks/bad_inputs.py [--json PATH] [--timeout 30]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(
    0, str(ROOT / "tests")
)  # the in-thread test servers: tests/engine_server.py, rollout_server.py

from asyncrl.services.runtime.auth import generate_token

MAX_ANSWER_BYTES = 4096  # a refusal bigger than this grows with its input: it echoes the request
CONTEXT = 512  # the tiny model's context length (max_position_embeddings)
MAX_BATCH = 8  # the engine's max_batch_size here
ENGINE_MAX_BODY = 4 << 20  # small caps, so that the 413 cases stay cheap to send
REWARD_MAX_BODY = 1 << 20
MB = 1 << 20
SENT_CHARS = 100  # body characters shown in the table's `sent` column


# --- bodies and cases ---------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """A body sent byte for byte (malformed JSON, NaN literals, JSON escapes of odd code points)."""

    data: bytes


@dataclass(frozen=True)
class Chunked:
    """A streamed body of `size` filler bytes between `head` and `tail`, with no Content-Length."""

    size: int
    head: bytes = b'{"text": "'
    tail: bytes = b'"}'


@dataclass(frozen=True)
class HeadersOnly:
    """Headers declaring a `declared`-byte body, then one byte: a server that waits for the body
    before refusing it never answers (raw socket)."""

    declared: int


NO_BODY = object()
JSON = "application/json"


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    body: Any = NO_BODY  # JSON-able value, Raw, Chunked, HeadersOnly or NO_BODY
    expect: tuple[int, ...] = (422,)
    content_type: str | None = JSON
    headers: dict[str, str] = field(default_factory=dict)
    check: Callable[[httpx.Response], str | None] | None = None  # a problem with the answer, or None


def post(name: str, path: str, body: Any, expect: int | tuple[int, ...] = 422, **kw) -> Case:
    return Case(name, "POST", path, body, expect if isinstance(expect, tuple) else (expect,), **kw)


def get(name: str, path: str, expect: int | tuple[int, ...] = 404, **kw) -> Case:
    return Case(name, "GET", path, NO_BODY, expect if isinstance(expect, tuple) else (expect,), **kw)


def mentions(*words: str) -> Callable[[httpx.Response], str | None]:
    """The refusal names its reason (a 4xx for another reason than the one tested misleads)."""

    def check(resp: httpx.Response) -> str | None:
        text = message_of(resp) or ""
        missing = [w for w in words if w not in text]
        return f"message does not mention {missing}" if missing else None

    return check


def message_is(expected: str) -> Callable[[httpx.Response], str | None]:
    def check(resp: httpx.Response) -> str | None:
        return None if message_of(resp) == expected else f"message differs: {message_of(resp)!r:.80}"

    return check


# --- the catalog --------------------------------------------------------------------------


@dataclass
class Setup:
    """What the cases refer to: the engine token and the weights paths."""

    token: str
    model_dir: Path
    weights_root: Path
    code_enabled: bool


def engine_cases(s: Setup) -> list[Case]:
    from asyncrl.services.engine.engine import MAX_CHARS_PER_TOKEN
    from asyncrl.services.engine.updates import REFUSED_PATH

    g, chat = "/generate", "/v1/chat/completions"
    one = {"max_new_tokens": 1}  # a case the engine accepts costs one token
    auth = {"Authorization": f"Bearer {s.token}"}
    refused = message_is(REFUSED_PATH)
    root = s.weights_root

    def disk(name: str, path: Any, expect: int = 400, **kw) -> Case:
        kw.setdefault("check", refused if expect == 400 else None)
        return post(name, "/update_weights_from_disk", {"model_path": path}, expect, headers=auth, **kw)

    def user(content: Any, role: Any = "user") -> list[dict]:
        return [{"role": role, "content": content}]

    return [
        # --- the body itself
        post("no content-type", g, {"text": "hi", "sampling_params": one}, (200, 415, 422),
             content_type=None),
        post("malformed JSON", g, Raw(b'{"text": "hi"'), (400, 422)),
        post("invalid UTF-8 bytes", g, Raw(b'{"text": "\xff\xfe"}'), (400, 422)),
        post("JSON array body", g, [1, 2, 3]),
        post("JSON number body", g, 42),
        post("100k-deep nested arrays", g, Raw(b"[" * 100_000 + b"]" * 100_000), (400, 422)),
        post("5000-digit integer", g, Raw(b'{"input_ids": [' + b"9" * 5000 + b"]}"), (400, 422)),
        # --- prompt inputs
        post("both text and input_ids", g, {"text": "hi", "input_ids": [1]}, check=mentions("exactly one")),
        post("neither text nor input_ids", g, {"sampling_params": one}, check=mentions("exactly one")),
        post("negative token id", g, {"input_ids": [1, -1]}, 400, check=mentions("vocabulary")),
        post("huge token id", g, {"input_ids": [1, 2**40]}, 400, check=mentions("vocabulary")),
        post("empty batch", g, {"text": []}, 400, check=mentions("empty batch")),
        post("batch over max_batch_size", g, {"input_ids": [[1, 5]] * (MAX_BATCH + 1)}, 400,
             check=mentions("max_batch_size")),
        post("per-item list on one prompt", g, {"input_ids": [1, 2, 3], "logprob_start_len": [1]}, 400,
             check=mentions("per-item list")),
        post("duplicate rids in a batch", g, {"text": ["a", "b"], "rid": ["x", "x"], "sampling_params": one},
             400, check=mentions("duplicate rid")),
        post("logprob_start_len -5", g,
             {"input_ids": [1, 5, 6], "return_logprob": True, "logprob_start_len": -5}, 400,
             check=mentions("logprob_start_len")),
        # --- sampling params
        post("max_new_tokens 10**9", g, {"text": "hi", "sampling_params": {"max_new_tokens": 10**9}}, 400,
             check=mentions("cap")),
        post("temperature NaN", g, Raw(b'{"text": "hi", "sampling_params": {"temperature": NaN}}')),
        post("temperature Infinity", g, Raw(b'{"text": "hi", "sampling_params": {"temperature": Infinity}}')),
        post("temperature -1", g, {"text": "hi", "sampling_params": {"temperature": -1}}),
        post("top_p 1.5", g, {"text": "hi", "sampling_params": {"top_p": 1.5}}),
        post("unknown top-level field", g, {"text": "hi", "best_of": 4}),
        post("stream true", g, {"text": "hi", "stream": True}, 400, check=mentions("stream")),
        post("regex", g, {"text": "hi", "sampling_params": {"regex": "a+"}}, 400),
        post("json_schema", g, {"text": "hi", "sampling_params": {"json_schema": "{}"}}, 400),
        post("stop strings", g, {"text": "hi", "sampling_params": {"stop": ["\n"]}}, 400),
        post("logit_bias", g, {"text": "hi", "sampling_params": {"logit_bias": {"5": 100.0}}}, 400),
        # --- odd code points, size
        post("lone surrogate in text", g, Raw(b'{"text": "a\\ud800b"}')),
        post("lone surrogate rid", g,
             Raw(b'{"text": "hi", "rid": "\\udfff", "sampling_params": {"max_new_tokens": 1}}'),
             (200, 400, 422)),
        post("NUL key and lone surrogate", g, Raw(b'{"text": "\\ud800", "k\\u0000": 1}')),
        post("NUL bytes in text", g, {"text": "a\x00b\x00", "sampling_params": one}, (200, 400)),
        post("10 MB text (body cap 4 MB)", g, {"text": "a" * (10 * MB)}, 413),
        post("text over the length bound", g, {"text": "a" * (CONTEXT * MAX_CHARS_PER_TOKEN + 1)}, 400,
             check=mentions("cannot fit")),
        post("text over the context", g, {"text": "ab" * CONTEXT}, 400, check=mentions("does not fit")),
        # --- chat completions
        post("chat: empty messages", chat, {"messages": []}),
        post("chat: empty role", chat, {"messages": user("hi", "")}),
        post("chat: unknown role", chat, {"messages": user("hi", "wizard"), "max_tokens": 1}, (200, 400)),
        post("chat: lone surrogate content", chat,
             Raw(b'{"messages": [{"role": "user", "content": "\\udc00"}]}')),
        post("chat: lone surrogate model", chat,
             Raw(b'{"model": "\\ud800", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}'),
             (200, 400, 422)),
        post("chat: negative max_tokens", chat, {"messages": user("hi"), "max_tokens": -5}),
        post("chat: n 2", chat, {"messages": user("hi"), "n": 2}),
        post("chat: stream true", chat, {"messages": user("hi"), "stream": True}, 400),
        post("chat: tools", chat, {"messages": user("hi"), "tools": [{"type": "function"}]}, 400),
        # --- control endpoints
        post("pause without a token", "/pause_generation", {}, 401),
        post("pause with a wrong token", "/pause_generation", {}, 401,
             headers={"Authorization": f"Bearer {generate_token()}"}),
        post("pause with the scheme only", "/pause_generation", {}, 401, headers={"Authorization": "Bearer"}),
        post("flush with lowercase bearer", "/flush_cache", NO_BODY, 200,
             headers={"Authorization": f"bearer {s.token}"}),
        post("pause with a bad mode", "/pause_generation", {"mode": "sleep"}, headers=auth),
        post("abort with binary garbage", "/abort_request", Raw(b"\x00\x01garbage"), (400, 422),
             headers=auth),
        post("abort with rid 123", "/abort_request", {"rid": 123}, headers=auth),
        post("disk update without a token", "/update_weights_from_disk", {"model_path": str(root / "x")},
             401),
        disk("disk: relative path", "ckpt"),
        disk("disk: '..' out of the root", f"{root}/../{s.model_dir.name}"),
        disk("disk: nonexistent", str(root / "nope")),
        disk("disk: a file, not a dir", str(root / "file.safetensors")),
        disk("disk: symlink out of the root", str(root / "escape")),
        disk("disk: dir of symlinks out", str(root / "links")),
        disk("disk: empty dir", str(root / "empty")),
        disk("disk: NUL byte in path", f"{root}/empty\x00/x"),
    ]  # fmt: skip


def reward_cases(s: Setup) -> list[Case]:
    r = "/v1/rewards"
    rev = {"verifier": "reverse", "target": "abc"}

    def items(*specs_and_completions: tuple[Any, Any]) -> dict:
        return {"items": [{"spec": spec, "completion": c, "id": str(i)}  # what varies first: see describe()
                          for i, (spec, c) in enumerate(specs_and_completions)]}  # fmt: skip

    def one(title: str, spec: Any, completion: Any = "x", expect: int | tuple[int, ...] = 422, **kw) -> Case:
        return post(title, r, items((spec, completion)), expect, **kw)

    def code(**spec: Any) -> dict:
        return {"verifier": "code", **spec}

    test = {"stdin": "", "stdout": "1"}
    cases = [
        post("malformed JSON", r, Raw(b'{"items": [')),
        post("items empty", r, {"items": []}),
        post("4097 items", r, {"items": [{"id": str(i), "completion": "x", "spec": rev}
                                         for i in range(4097)]}),
        post("duplicate ids", r, {"items": [{"id": "a", "completion": "x", "spec": rev}] * 2},
             check=mentions("unique")),
        post("unknown item key", r, {"items": [{"id": "a", "completion": "x", "spec": rev, "weight": 2}]}),
        post("spec missing", r, {"items": [{"id": "a", "completion": "x"}]}, check=mentions("spec")),
        one("unknown verifier", {"verifier": "nosuch"}, check=mentions("unknown")),
        one("judge (not configured)", {"verifier": "judge"}, check=mentions("unknown")),
        one("reverse target a list", {"verifier": "reverse", "target": ["a", "b"]}),
        one("reverse unknown key", {"verifier": "reverse", "tgt": "abc"}),
        one("arith answer not an integer", {"verifier": "arith", "answer": "twelve"}),
        one("math empty answer", {"verifier": "math", "answer": ""}),
        one("math gold unparseable", {"verifier": "math", "answer": "\\frac{"}, "\\boxed{1}", 200),
        one("math completion unparseable", {"verifier": "math", "answer": "1"}, "\\boxed{\\frac{{{{", 200),
        one("math 500k open braces", {"verifier": "math", "answer": "1"}, "{" * 500_000, 200),
        one("math power towers", {"verifier": "math", "answer": "10^{10^{10^{10^{10}}}}"},
            "\\boxed{9^{9^{9^{9^{9}}}}}", 200),
        post("lone surrogate completion", r,
             Raw(b'{"items": [{"id": "a", "spec": {"verifier": "reverse"}, "completion": "a\\ud800b"}]}')),
        post("lone surrogate spec argument", r,
             Raw(b'{"items": [{"id": "a", "spec": {"verifier": "reverse", "target": "a\\ud800"}, '
                 b'"completion": "a"}]}')),
        post("NUL key", r, Raw(b'{"items": [{"id": "a", "spec": {"verifier": "reverse"}, "completion": "x", '
                              b'"k\\u0000": 1}]}')),
        one("NULs in completion", rev, "a\x00b\x00c", 200),
        one("1 MB+ body (cap 1 MB)", rev, "x" * (REWARD_MAX_BODY + 10), 413),
        post("chunked 2 MB body (cap 1 MB)", r, Chunked(2 * MB, b'{"items": [{"id": "a", "completion": "'),
             413),
    ]  # fmt: skip
    code_cases = [
        one("code: tests empty", code(tests=[])),
        one("code: tests and asserts", code(tests=[test], assert_code="assert True")),
        one("code: 300 tests (max 256)", code(tests=[test] * 300)),
        one("code: timeout_s 1000", code(tests=[test], timeout_s=1000)),
        one("code: memory_mb 10**9", code(tests=[test], memory_mb=10**9)),
        one("code: infinite loop", code(tests=[test], timeout_s=1), "while True: pass", 200),
        one("code: endless output", code(tests=[test], timeout_s=2), "while True: print('x' * 65536)", 200),
        one("code: fork bomb", code(tests=[test], timeout_s=2), "import os\nwhile True: os.fork()", 200),
    ]  # fmt: skip
    return cases + (code_cases if s.code_enabled else [])


def rollout_cases(s: Setup) -> list[Case]:
    r, ev = "/v1/rollouts", "/v1/evaluations"
    spec = {"verifier": "reverse"}
    cheap = {"max_new_tokens": 4}  # an accepted job is really generated: keep it short

    def body(given: dict[str, Any], **defaults: Any) -> dict[str, Any]:
        """The fields a case sets first (what describe() shows), then the valid defaults; None drops one."""
        merged = {**given, **{k: v for k, v in defaults.items() if k not in given}}
        return {k: v for k, v in merged.items() if v is not None}

    def job(title: str, /, prompts: Any = None, expect: int | tuple[int, ...] = 422, **fields: Any) -> Case:
        given = ({"prompts": prompts} if prompts is not None else {}) | fields
        return post(title, r, body(given, prompts=[{"text": "abc>"}], group_size=1, sampling_params=cheap,
                                   reward_spec=spec), expect)  # fmt: skip

    def evaluation(title: str, /, expect: int = 422, **fields: Any) -> Case:
        defaults = {"prompts": [{"text": "abc>"}], "reward_spec": spec, "sampling_params": cheap}
        return post(title, ev, body(fields, **defaults), expect)

    key = f"bad-inputs-{os.getpid()}"
    return [
        post("malformed JSON", r, Raw(b'{"prompts": [{"text": "a"'), 400),
        post("NUL key and lone surrogate", r,
             Raw(b'{"prompts": [{"text": "\\ud800", "k\\u0000": 1}], '
                 b'"reward_spec": {"verifier": "reverse"}}')),
        post("lone surrogate text", r,
             Raw(b'{"prompts": [{"text": "a\\ud800b"}], "reward_spec": {"verifier": "reverse"}}')),
        job("empty prompts", []),
        job("100 001 prompts", [{"text": "a"}] * 100_001),
        job("whitespace-only text", [{"text": "   "}]),
        job("text and input_ids", [{"text": "a", "input_ids": [1]}]),
        job("prompt over the context", [{"text": "a" * (CONTEXT + 10)}], 400),
        job("input_ids out of vocabulary", [{"input_ids": [5, 999_999]}], 400),
        job("negative input_ids", [{"input_ids": [-1]}]),
        job("empty messages", [{"messages": []}]),
        job("messages empty role", [{"messages": [{"role": "", "content": "hi"}]}]),
        job("messages unknown role", [{"messages": [{"role": "wizard", "content": "hi"}]}], (202, 400)),
        job("group_size 0", group_size=0),
        job("group_size 10**6", group_size=10**6),
        job("unknown verifier", reward_spec={"verifier": "nosuch"}, expect=400),
        job("verifier an int", reward_spec={"verifier": 5}),
        job("reverse target a list", reward_spec={"verifier": "reverse", "target": ["a", "b"]}),
        job("reward spec unknown key", reward_spec={"verifier": "reverse", "bogus": 1}),
        job("no reward spec anywhere", reward_spec=None),
        job("stop strings", sampling_params={"stop": ["\n"]}, expect=400),
        job("logit_bias", sampling_params={"logit_bias": {"5": 1.0}}, expect=400),
        job("sampling n 4", sampling_params={"n": 4}),
        job("max_new_tokens over the cap", sampling_params={"max_new_tokens": 100_000}, expect=400),
        post("temperature NaN", r,
             Raw(b'{"prompts": [{"text": "a"}], "reward_spec": {"verifier": "reverse"}, '
                 b'"sampling_params": {"temperature": NaN}}')),
        job("10k-char idempotency key", idempotency_key="k" * 10_000),
        job("first use of a key (valid)", idempotency_key=key, expect=202),
        job("key reused, other body", idempotency_key=key, group_size=2, expect=409),
        post("100 MB declared, headers only", r, HeadersOnly(100 * MB), 413),
        get("GET unknown job", f"{r}/jdoesnotexist"),
        Case("DELETE unknown job", "DELETE", f"{r}/jdoesnotexist", expect=(404,)),
        get("GET 5000-char job id", f"{r}/{'j' * 5000}"),
        post("eval: empty body", ev, {}),
        evaluation("eval: name '../etc'", name="../etc"),
        evaluation("eval: empty prompts", prompts=[]),
        evaluation("eval: stop strings", sampling_params={"stop": ["x"]}, expect=400),
        evaluation("eval: unknown verifier", reward_spec={"verifier": "nosuch"}, expect=400),
        evaluation("eval: target a list", reward_spec={"verifier": "reverse", "target": ["x"]}),
        get("eval: GET unknown", f"{ev}/enope"),
        get("eval: GET 5000-char id", f"{ev}/{'e' * 5000}"),
    ]  # fmt: skip


# --- running a case -----------------------------------------------------------------------


@dataclass
class Result:
    service: str
    case: str
    sent: str
    status: int | str  # an HTTP status, "timeout" or "no answer"
    clear_4xx: bool
    bytes: int
    seconds: float
    note: str = ""


def message_of(resp: httpx.Response) -> str | None:
    """The human message of an answer: SGLang's `error.message`, ours `message`, FastAPI's `detail`."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip() or None
    if isinstance(body, dict):
        error = body.get("error")
        for value in (error.get("message") if isinstance(error, dict) else None, body.get("message"),
                      body.get("detail")):  # fmt: skip
            if isinstance(value, list) and value:
                value = value[0].get("msg") if isinstance(value[0], dict) else value[0]
            if isinstance(value, str) and value.strip():
                return value
    return None


def encode(case: Case) -> tuple[bytes | Iterator[bytes] | None, dict[str, str]]:
    headers = dict(case.headers)
    if case.content_type is not None and case.body is not NO_BODY:
        headers["content-type"] = case.content_type
    if case.body is NO_BODY:
        return None, headers
    if isinstance(case.body, Raw):
        return case.body.data, headers
    if isinstance(case.body, Chunked):
        chunk = b"a" * MB
        body = case.body

        def stream() -> Iterator[bytes]:
            yield body.head
            for _ in range(body.size // MB):
                yield chunk
            yield body.tail

        return stream(), headers
    return json.dumps(case.body).encode(), headers


def describe(case: Case) -> str:
    """What was sent, in short: method, path, odd headers and the body's start and size."""
    path = case.path if len(case.path) <= 40 else f"{case.path[:30]}…({len(case.path)} chars)"
    parts = [case.method, path]
    if case.content_type != JSON and case.body is not NO_BODY:
        parts.append(f"[content-type: {case.content_type or 'none'}]")
    if "Authorization" in case.headers:
        scheme, _, credential = case.headers["Authorization"].partition(" ")
        parts.append(f"[auth: {scheme} {'<token>' if credential else '<empty>'}]")
    body = case.body
    if isinstance(body, Chunked):
        parts.append(f"chunked {human(body.size)}, no length")
    elif isinstance(body, HeadersOnly):
        parts.append(f"Content-Length {human(body.declared)}, 1 byte sent")
    elif body is not NO_BODY:
        data = body.data if isinstance(body, Raw) else json.dumps(body).encode()
        text = data[:SENT_CHARS].decode("ascii", "backslashreplace").replace("\x00", "\\x00")
        parts.append(text if len(data) <= SENT_CHARS else f"{text[: SENT_CHARS - 20]}… ({human(len(data))})")
    return " ".join(parts)


def human(n: int) -> str:
    return f"{n / MB:.0f} MB" if n >= MB else f"{n / 1024:.0f} kB" if n >= 10_000 else f"{n} B"


def send_headers_only(base_url: str, case: Case, timeout_s: float) -> tuple[int, bytes]:
    url = httpx.URL(base_url)
    assert isinstance(case.body, HeadersOnly)
    head = (f"{case.method} {case.path} HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: {case.content_type}\r\n"
            f"Content-Length: {case.body.declared}\r\nConnection: close\r\n\r\n{{")  # fmt: skip
    with socket.create_connection((url.host, url.port), timeout=timeout_s) as sock:
        sock.sendall(head.encode())
        data = b""
        while b"\r\n\r\n" not in data and (chunk := sock.recv(65536)):
            data += chunk
        status_line, _, rest = data.partition(b"\r\n")
        headers, _, body = rest.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in headers.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
        while len(body) < length and (chunk := sock.recv(65536)):
            body += chunk
    return int(status_line.split()[1]), body


def run_case(service: str, base_url: str, case: Case, timeout_s: float) -> Result:
    """One case on a connection of its own: a server that drops a connection after an error
    (uvicorn after a 500) must not turn the next case into a "no answer"."""
    started = time.monotonic()
    note = ""
    try:
        if isinstance(case.body, HeadersOnly):
            status, content = send_headers_only(base_url, case, timeout_s)
            resp = httpx.Response(status, content=content)
        else:
            body, headers = encode(case)
            with httpx.Client(timeout=timeout_s) as client:
                resp = client.request(case.method, base_url + case.path, content=body, headers=headers)
            status, content = resp.status_code, resp.content
    except (httpx.TimeoutException, TimeoutError):
        return Result(service, case.name, describe(case), "timeout", False, 0, time.monotonic() - started)
    except (httpx.TransportError, OSError) as exc:
        return Result(service, case.name, describe(case), "no answer", False, 0, time.monotonic() - started,
                      f"{type(exc).__name__}: {exc}"[:100])  # fmt: skip
    seconds = time.monotonic() - started
    clear = 400 <= status < 500 and bool(message_of(resp))
    if status not in case.expect:
        note = f"expected {'/'.join(map(str, case.expect))}"
    elif case.check is not None and (problem := case.check(resp)):
        note = problem
    return Result(service, case.name, describe(case), status, clear, len(content), seconds, note)


# --- the services -------------------------------------------------------------------------


def prepare_weights_root(tmp: Path, model_dir: Path) -> Path:
    """A weights root holding each kind of path that must be refused with the same message."""
    root = tmp / "weights"
    (root / "empty").mkdir(parents=True)
    (root / "links").mkdir()
    (root / "file.safetensors").write_bytes(b"not a checkpoint")
    (root / "escape").symlink_to(model_dir, target_is_directory=True)
    for weights in model_dir.glob("*.safetensors"):
        (root / "links" / weights.name).symlink_to(weights)
    return root


def start_reward(stack: contextlib.ExitStack) -> tuple[str, bool]:
    """The reward service (1 MB body cap) with `code` when bubblewrap works here, else without."""
    from engine_server import free_port

    from asyncrl.services.reward.app import build_app
    from asyncrl.services.reward.config import RewardSettings
    from asyncrl.services.reward.sandbox import SandboxUnavailable
    from asyncrl.services.runtime.serving import serve_app_in_thread

    code_enabled = shutil.which("bwrap") is not None
    common = {"max_body_bytes": REWARD_MAX_BODY, "math_workers": 1, "code_concurrency": 2}
    try:
        app = build_app(RewardSettings(code_enabled=code_enabled, **common))
    except SandboxUnavailable as exc:
        print(f"code verifier off, its cases skipped: {exc}", file=sys.stderr)
        code_enabled = False
        app = build_app(RewardSettings(code_enabled=False, **common))
    http = serve_app_in_thread(app, free_port(), "reward")
    stack.callback(http.stop)
    return http.url, code_enabled


def start_services(tmp: Path, stack: contextlib.ExitStack) -> tuple[dict[str, str], Setup]:
    import torch
    from engine_server import serve_in_thread as serve_engine
    from rollout_server import serve_in_thread as serve_rollout

    from asyncrl.buffer.server import RedisServer
    from asyncrl.services.ops.tinymodel import build_tiny_model

    torch.set_num_threads(1)
    model_dir = tmp / "model"
    build_tiny_model(model_dir, seed=0, max_position_embeddings=CONTEXT)
    token = generate_token()
    root = prepare_weights_root(tmp, model_dir)
    engine = serve_engine(str(model_dir), tokenless_control=False, api_token=token, weights_root=str(root),
                          max_batch_size=MAX_BATCH, max_body_bytes=ENGINE_MAX_BODY)  # fmt: skip
    stack.callback(engine.stop)
    reward_url, code_enabled = start_reward(stack)
    redis = RedisServer(tmp / "redis").start()
    stack.callback(redis.stop)
    rollout = serve_rollout(redis.url, tokenizer=str(model_dir), run="bad-inputs", replica="r0",
                            engine_urls=engine.url, reward_url=reward_url)  # fmt: skip
    stack.callback(rollout.stop)
    urls = {"engine": engine.url, "reward": reward_url, "rollout": rollout.url}
    return urls, Setup(token, model_dir, root, code_enabled)


# --- report -------------------------------------------------------------------------------


def failed(r: Result) -> bool:
    return isinstance(r.status, str) or r.status >= 500 or r.bytes > MAX_ANSWER_BYTES


def summary(results: list[Result]) -> dict:
    codes = [r.status for r in results if isinstance(r.status, int)]
    largest = max(results, key=lambda r: r.bytes)
    return {
        "cases": len(results),
        "4xx": sum(400 <= c < 500 for c in codes),
        "5xx": sum(c >= 500 for c in codes),
        "timeouts": sum(r.status == "timeout" for r in results),
        "no_answer": sum(r.status == "no answer" for r in results),
        "over_max_answer": sum(r.bytes > MAX_ANSWER_BYTES for r in results),
        "unexpected": sum(bool(r.note) for r in results),
        "largest_answer_bytes": largest.bytes,
        "largest_answer_case": f"{largest.service}: {largest.case}",
        "failed": sum(failed(r) for r in results),
    }


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


def print_table(results: list[Result]) -> None:
    print("| service | case | sent | status | clear 4xx | bytes | s | note |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        status = f"{r.status} ⚠" if failed(r) else r.status
        clear = "yes" if r.clear_4xx else "no"
        print(f"| {r.service} | {cell(r.case)} | `{cell(r.sent)}` | {status} | {clear} | {r.bytes} | "
              f"{r.seconds:.3f} | {cell(r.note)} |")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results and summary as JSON")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request before a hang")
    args = parser.parse_args()
    # The services' data planes would ask every case for this token: the cases test input
    # handling, and the engine's control plane gets its own token below.
    for name in ("ASYNCRL_API_TOKEN", "ASYNCRL_ENGINE_API_TOKEN"):
        os.environ.pop(name, None)

    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bad-inputs-") as tmp, contextlib.ExitStack() as stack:
        urls, setup = start_services(Path(tmp), stack)
        catalog = {
            "engine": engine_cases(setup),
            "reward": reward_cases(setup),
            "rollout": rollout_cases(setup),
        }
        for service, cases in catalog.items():
            for case in cases:
                results.append(run_case(service, urls[service], case, args.timeout))

    print_table(results)
    totals = summary(results)
    print(
        f"\ncases: {totals['cases']}, 4xx: {totals['4xx']}, 5xx: {totals['5xx']}, "
        f"hangs/timeouts: {totals['timeouts']}, no answer: {totals['no_answer']}, "
        f"unexpected status: {totals['unexpected']}, largest answer: {totals['largest_answer_bytes']} B "
        f"({totals['largest_answer_case']}), over {MAX_ANSWER_BYTES} B: {totals['over_max_answer']}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"summary": totals, "cases": [asdict(r) for r in results]}, indent=1)
        )
    return 1 if totals["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
