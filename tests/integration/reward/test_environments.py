"""The reward service's environments over real HTTP (uvicorn on loopback): the list,
`secret` (seeded, stateless, judged), `calculator` (safe arithmetic), `python` (real bubblewrap),
refusals (404, 422) and the Prometheus counters each call moves."""

from __future__ import annotations

import random
import shutil
import threading
import time

import httpx
import pytest
from engine_server import free_port
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.services.runtime.serving import serve_app_in_thread

HAS_BWRAP = shutil.which("bwrap") is not None
TIMEOUT_S = 1.0  # the python tool's time limit here
OUTPUT_CHARS = 256


@pytest.fixture(scope="module")
def service():
    from asyncrl.services.reward.app import build_app
    from asyncrl.services.reward.config import RewardSettings

    settings = RewardSettings(
        code_enabled=HAS_BWRAP,
        code_uid_base=2_200_000,
        math_workers=1,
        env_python_timeout_s=TIMEOUT_S,
        env_python_output_chars=OUTPUT_CHARS,
        code_output_bytes=64 * 1024,
        code_tmpfs_mb=8,
    )
    http = serve_app_in_thread(build_app(settings), free_port(), "reward")
    with httpx.Client(base_url=http.url, timeout=60) as client:
        yield client
    http.stop()


@pytest.fixture
def python_env(service):
    if not HAS_BWRAP:
        pytest.skip(
            "bubblewrap is not installed (apt-get install bubblewrap): the python environment needs it"
        )
    return service


def step(client, env: str, action: dict, *, seed: int = 0, args: dict | None = None, turn: int = 0) -> dict:
    body = {"episode_id": "e1", "seed": seed, "turn": turn, "args": args or {}, "action": action}
    reply = client.post(f"/v1/environments/{env}/step", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def tool(name: str, arguments: dict | str | None = None) -> dict:
    return {"tool_call": {"name": name, "arguments": {} if arguments is None else arguments}}


def metric(client, name: str, **labels) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def expected_secret(seed: int, letters: str = "abcdefghij", length: int = 3) -> str:
    """The rule the environment documents, written out: `length` draws of random.Random(seed)."""
    rng = random.Random(seed)
    return "".join(rng.choice(letters) for _ in range(length))


# ---------------------------------------------------------------- list


def test_list_names_each_environment_with_its_tools(service):
    reply = service.get("/v1/environments")
    assert reply.status_code == 200
    envs = reply.json()["environments"]
    assert set(envs) == {"secret", "calculator", "python"} if HAS_BWRAP else {"secret", "calculator"}
    assert envs["secret"]["judges"] is True and envs["calculator"]["judges"] is False
    assert [t["function"]["name"] for t in envs["secret"]["tools"]] == ["lookup"]
    calculator = envs["calculator"]["tools"][0]
    assert calculator["type"] == "function" and calculator["function"]["name"] == "calculator"
    assert calculator["function"]["parameters"]["required"] == ["expression"]
    if HAS_BWRAP:
        assert envs["python"]["judges"] is False
        assert envs["python"]["tools"][0]["function"]["parameters"]["required"] == ["code"]


# ---------------------------------------------------------------- secret


def test_secret_lookup_tells_the_seeds_secret_and_the_answer_is_scored_by_position(service):
    args = {"letters": "xyz", "length": 5}
    reset = service.post("/v1/environments/secret/reset", json={"episode_id": "e1", "seed": 7, "args": args})
    assert reset.status_code == 200
    assert reset.json()["observation"] == ""
    assert [t["function"]["name"] for t in reset.json()["tools"]] == ["lookup"]

    looked = step(service, "secret", tool("lookup"), seed=7, args=args)
    secret = expected_secret(7, "xyz", 5)
    assert (looked["observation"], looked["reward"], looked["done"], looked["status"]) == (
        secret,
        0.0,
        False,
        "ok",
    )
    assert not looked["mask_sample"]

    def score(text: str) -> float:
        final = step(service, "secret", {"text": text}, seed=7, args=args, turn=1)
        assert (final["done"], final["status"]) == (True, "ok")
        return final["reward"]

    flip = {"x": "y", "y": "z", "z": "x"}
    assert score(looked["observation"]) == 1.0
    assert score(secret + "extra") == 1.0  # characters past the secret's length are ignored
    assert score(flip[secret[0]] + secret[1:]) == 4 / 5  # one position wrong
    assert score(secret[:2]) == 2 / 5  # missing positions are wrong
    assert score("".join(flip[c] for c in secret)) == 0.0
    assert score("") == 0.0


def test_secret_needs_no_state_the_seed_decides(service):
    first = [
        step(service, "secret", tool("lookup"), seed=s, args={"length": 6})["observation"] for s in range(8)
    ]
    again = [
        step(service, "secret", tool("lookup"), seed=s, args={"length": 6})["observation"] for s in range(8)
    ]
    assert first == again == [expected_secret(s, length=6) for s in range(8)]
    assert len(set(first)) == 8  # different seeds, different secrets
    default = step(service, "secret", tool("lookup", "? anything a small model wrote"), seed=3)
    assert default["observation"] == expected_secret(
        3
    )  # defaults: "abcdefghij", 3 letters; arguments ignored


def test_secret_unknown_tool_is_an_invalid_call_the_episode_goes_on(service):
    reply = step(service, "secret", tool("search", {"q": "secret"}))
    assert (reply["status"], reply["done"], reply["reward"]) == ("invalid_call", False, 0.0)
    assert "'search'" in reply["observation"] and "lookup" in reply["observation"]


def test_secret_refuses_bad_task_arguments(service):
    for args, named in [
        ({"length": 0}, "length"),
        ({"colour": "red"}, "colour"),
        ({"letters": ""}, "letters"),
    ]:
        reply = service.post(
            "/v1/environments/secret/step",
            json={"episode_id": "e", "turn": 0, "args": args, "action": tool("lookup")},
        )
        assert reply.status_code == 422, reply.text
        assert reply.json()["message"].startswith(f"body.args.{named}: "), reply.json()
        assert reply.json()["detail"][0]["loc"] == ["body", "args", named]


# ---------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    ("arguments", "value"),
    [
        ({"expression": "2*(3+4)"}, "14"),
        ({"expression": "7/2"}, "3.5"),
        ({"expression": "-2**3 + 10 // 3 + 10 % 3"}, "-4"),  # -8 + 3 + 1
        ({"expression": "2**-2"}, "0.25"),
        ({"expression": "2**100"}, str(2**100)),
        ("  (1 + 2) * 3  ", "9"),  # raw argument text is the expression
    ],
)
def test_calculator_values(service, arguments, value):
    reply = step(service, "calculator", tool("calculator", arguments))
    assert (reply["observation"], reply["status"], reply["done"], reply["reward"]) == (
        value,
        "ok",
        False,
        None,
    )


def test_calculator_errors_are_tool_errors(service):
    cases = {
        "1/0": "division by zero",
        "5 % 0": "division by zero",
        "9**9**9": "too large",
        "10.0**400": "too large",
        "(-8)**0.5": "not a real number",
        "2 +": "syntax error",
        "x + 1": "unsupported: names",
        "__import__('os').system('id')": "unsupported: calls",
        "(1).real": "unsupported: attributes",
        "True + 1": "unsupported: the constant True",
    }
    for expression, error in cases.items():
        started = time.monotonic()
        reply = step(service, "calculator", tool("calculator", {"expression": expression}))
        assert reply["status"] == "tool_error" and error in reply["observation"], (expression, reply)
        assert not reply["done"]
        assert time.monotonic() - started < 5  # 9**9**9 computed would take hours: it is refused before


def test_step_batch_answers_a_crashing_step_in_band_and_the_others_as_alone():
    """One item of a batch whose step raises is masked (`crash`, counted once); the rest of the
    batch is answered as each item is alone. The crash is a user's environment with a bug (the
    built-ins answer every input they are given), served by the real service over HTTP."""
    from asyncrl.proto.environments import StepResponse
    from asyncrl.services.reward.app import build_app
    from asyncrl.services.reward.config import RewardSettings
    from asyncrl.services.reward.environments.base import Environment, function, reply, text_argument

    class Halver(Environment):
        name = "halver"
        description = "Halves a number; its author forgot odd ones."
        tools = [function("halve", "Half of `n`.", {"n": {"type": "string"}})]

        async def call(self, args, req, call) -> StepResponse:
            n = int(text_argument(call, "n") or "0")
            if n % 2:
                raise ArithmeticError(f"{n} is odd")  # the bug: not a tool error, the environment fails
            return reply(str(n // 2))

    http = serve_app_in_thread(build_app(RewardSettings(code_enabled=False, math_workers=1),
                                         environments={"halver": Halver()}), free_port(), "reward")  # fmt: skip
    try:
        with httpx.Client(base_url=http.url, timeout=60) as client:
            actions = {
                "value": tool("halve", {"n": "14"}),
                "crash": tool("halve", {"n": "7"}),
                "another": tool("halve", {"n": "100"}),
                "unknown_tool": tool("python", {"code": "print(1)"}),
                "answer": {"text": "The answer is 7."},
            }
            items = {
                name: {"episode_id": name, "turn": 0, "action": action} for name, action in actions.items()
            }
            alone = {}
            for name, body in items.items():
                if name != "crash":
                    single = client.post("/v1/environments/halver/step", json=body)
                    assert single.status_code == 200, single.text
                    alone[name] = single.json()
            assert (alone["value"]["observation"], alone["another"]["observation"]) == ("7", "50")
            assert alone["unknown_tool"]["status"] == "invalid_call" and alone["answer"]["done"]

            crash_kind = {"environment": "halver", "kind": "crash"}
            crashes = metric(client, "asyncrl_reward_env_failures_total", **crash_kind)
            reply_ = client.post("/v1/environments/halver/step_batch", json={"items": list(items.values())})
            assert reply_.status_code == 200, reply_.text
            results = dict(zip(items, reply_.json()["results"], strict=True))
            assert results.pop("crash") == {
                "observation": "environment error: ArithmeticError", "reward": None, "done": True,
                "status": "tool_error", "state": {}, "info": {}, "mask_sample": True, "failure_kind": "crash",
            }  # fmt: skip
            assert results == alone
            assert metric(client, "asyncrl_reward_env_failures_total", **crash_kind) == crashes + 1
    finally:
        http.stop()


def test_calculator_refuses_a_power_tower_without_overflowing(service):
    """`3**2**1024`: the exponent is a 1025-bit int; the size check must not multiply it by a
    float (OverflowError, which once escaped the environment as a 500)."""
    from asyncrl.services.reward.environments.calculator import CalculatorError, evaluate

    for expression in ("3**2**1024", "(-3)**2**1024", "2**2**2**2**2"):
        with pytest.raises(CalculatorError, match="too large"):
            evaluate(expression)
    assert evaluate("2**2**2**2") == 65536
    answer = step(service, "calculator", tool("calculator", {"expression": "3**2**1024"}))
    assert (answer["status"], answer["mask_sample"]) == ("tool_error", False) and "too large" in answer[
        "observation"
    ]


def test_calculator_wrong_arguments_are_invalid_calls_and_text_ends_the_episode(service):
    for arguments in [{}, {"expr": "1"}, {"expression": 1}, {"expression": "1", "extra": 2}]:
        reply = step(service, "calculator", tool("calculator", arguments))
        assert reply["status"] == "invalid_call" and "expression" in reply["observation"], arguments
    final = step(service, "calculator", {"text": "The answer is 14."})
    assert (final["done"], final["reward"], final["status"]) == (True, None, "ok")


# ---------------------------------------------------------------- python


def test_python_stdout_is_the_observation(python_env):
    reply = step(python_env, "python", tool("python", {"code": "print(6 * 7)"}))
    assert (reply["observation"], reply["status"], reply["done"], reply["reward"]) == (
        "42\n",
        "ok",
        False,
        None,
    )
    assert reply["info"]["exit_code"] == 0
    raw = step(python_env, "python", tool("python", "import sys\nprint('a'); print('b', file=sys.stderr)"))
    assert (raw["observation"], raw["status"]) == ("a\nb\n", "ok")  # stdout, then stderr


def test_python_failure_is_a_tool_error_with_its_traceback(python_env):
    code = "print('partial')\nraise ValueError('boom')"
    reply = step(python_env, "python", tool("python", {"code": code}))
    assert reply["status"] == "tool_error" and not reply["done"] and not reply["mask_sample"]
    text = reply["observation"]
    assert text.startswith("partial\nTraceback")
    assert text.endswith("ValueError: boom\n[exit code 1]")
    assert reply["info"]["exit_code"] == 1


def test_python_infinite_loop_is_killed_at_the_time_limit(python_env):
    started = time.monotonic()
    reply = step(python_env, "python", tool("python", "print('started', flush=True)\nwhile True:\n    pass"))
    assert reply["status"] == "timeout" and not reply["done"]
    assert reply["observation"] == f"started\n[killed: time limit of {TIMEOUT_S:g} s]"
    assert time.monotonic() - started < 10


def test_python_output_is_cut_and_says_so(python_env):
    code = "print('x' * 10000)\nimport sys\nsys.exit('y' * 1000 + 'END')"  # 10001 + 1004 characters
    reply = step(python_env, "python", tool("python", code))
    text, n = reply["observation"], OUTPUT_CHARS
    assert reply["status"] == "tool_error"
    assert text.startswith("x" * n + f"\n[stdout cut: the first {n} of 10001 characters shown]\n")
    stderr_tail = "y" * (n - 4) + "END\n"
    assert text.endswith(f"[stderr cut: the last {n} of 1004 characters shown]\n{stderr_tail}[exit code 1]")


def test_python_calls_share_nothing(python_env):
    wrote = step(
        python_env, "python", tool("python", "open('/work/notes.txt', 'w').write('kept')\nprint('ok')")
    )
    assert wrote["observation"] == "ok\n"
    read = step(python_env, "python", tool("python", "print(open('/work/notes.txt').read())"))
    assert read["status"] == "tool_error" and "FileNotFoundError" in read["observation"]
    assert step(python_env, "python", tool("python", {"code": 5}))["status"] == "invalid_call"


def test_python_sandbox_that_cannot_start_masks_the_episode(python_env):
    """A real sandbox whose interpreter is missing: bwrap cannot exec it, so the program never
    runs. That is the environment's failure: masked and counted, never a tool error or a 0."""
    from asyncrl.services.reward.app import build_app
    from asyncrl.services.reward.config import RewardSettings
    from asyncrl.services.reward.environments.python import PythonEnvironment
    from asyncrl.services.reward.sandbox import Sandbox

    sandbox = Sandbox(python="/usr/bin/no-such-python", slots=1, uid_base=2_200_100)
    env = PythonEnvironment(
        sandbox, timeout_s=2, memory_mb=256, output_chars=256, queue_timeout_s=5,
        output_bytes=4096, tmpfs_mb=1, max_procs=8, max_files=32,
    )  # fmt: skip
    http = serve_app_in_thread(
        build_app(RewardSettings(code_enabled=False, math_workers=1), environments={"python": env}),
        free_port(), "reward-broken",
    )  # fmt: skip
    try:
        with httpx.Client(base_url=http.url, timeout=60) as client:
            failures = metric(
                client, "asyncrl_reward_env_failures_total", environment="python", kind="sandbox"
            )
            reply = step(client, "python", tool("python", "print(1)"))
            assert (reply["mask_sample"], reply["failure_kind"], reply["done"]) == (True, "sandbox", True)
            assert reply["reward"] is None and "not scored" in reply["observation"]
            assert reply["info"]["error"]
            after = metric(client, "asyncrl_reward_env_failures_total", environment="python", kind="sandbox")
            assert after == failures + 1
    finally:
        http.stop()


# ---------------------------------------------------------------- refusals


def test_unknown_environment_is_a_404_with_a_message(service):
    body = {"episode_id": "e", "turn": 0, "action": {"text": "hi"}}
    for path, payload in [
        ("/v1/environments/nope/step", body),
        ("/v1/environments/nope/reset", {"episode_id": "e"}),
    ]:
        reply = service.post(path, json=payload)
        assert reply.status_code == 404
        assert reply.json() == {"detail": "unknown or disabled environment 'nope'"}


def test_malformed_bodies_are_refused_with_a_message(service):
    url = "/v1/environments/secret/step"
    both = {"episode_id": "e", "turn": 0, "action": {"text": "a", "tool_call": {"name": "lookup"}}}
    cases = [
        ({"episode_id": "e", "turn": 0}, "action"),
        (both, "exactly one of `tool_call` or `text`"),
        ({"episode_id": "e", "turn": 64, "action": {"text": "a"}}, "turn"),
        ({"episode_id": "e", "turn": 0, "seed": -1, "action": {"text": "a"}}, "seed"),
    ]
    for body, named in cases:
        reply = service.post(url, json=body)
        assert reply.status_code == 422, reply.text
        assert named in reply.json()["message"], reply.json()
    garbled = service.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert garbled.status_code == 422 and garbled.json()["message"]


# ---------------------------------------------------------------- metrics


def test_metrics_count_resets_steps_by_status_and_refusals(service):
    counters = {
        "resets": ("asyncrl_reward_env_resets_total", {"environment": "secret"}),
        "secret_ok": ("asyncrl_reward_env_steps_total", {"environment": "secret", "status": "ok"}),
        "secret_invalid": (
            "asyncrl_reward_env_steps_total",
            {"environment": "secret", "status": "invalid_call"},
        ),
        "calc_ok": ("asyncrl_reward_env_steps_total", {"environment": "calculator", "status": "ok"}),
        "calc_error": (
            "asyncrl_reward_env_steps_total",
            {"environment": "calculator", "status": "tool_error"},
        ),
        "latency": ("asyncrl_reward_env_step_seconds_count", {"environment": "secret"}),
        "unknown": ("asyncrl_reward_env_requests_rejected_total", {"reason": "unknown_environment"}),
        "invalid_body": ("asyncrl_reward_env_requests_rejected_total", {"reason": "invalid_body"}),
    }

    def read() -> dict[str, float]:
        return {key: metric(service, name, **labels) for key, (name, labels) in counters.items()}

    before = read()
    assert service.post("/v1/environments/secret/reset", json={"episode_id": "m"}).status_code == 200
    step(service, "secret", tool("lookup"))
    step(service, "secret", {"text": "abc"})
    step(service, "secret", tool("nope"))
    step(service, "calculator", tool("calculator", "1+1"))
    step(service, "calculator", tool("calculator", "1/0"))
    step(service, "calculator", tool("calculator", "1/0"))
    assert service.post("/v1/environments/nope/reset", json={"episode_id": "m"}).status_code == 404
    assert service.post("/v1/environments/secret/step", json={"episode_id": "m"}).status_code == 422
    bad_args = {"episode_id": "m", "turn": 0, "args": {"length": -1}, "action": {"text": "a"}}
    assert service.post("/v1/environments/secret/step", json=bad_args).status_code == 422
    moved = {key: value - before[key] for key, value in read().items()}
    assert moved == {
        "resets": 1, "secret_ok": 2, "secret_invalid": 1, "calc_ok": 1, "calc_error": 2, "latency": 3,
        "unknown": 1, "invalid_body": 2,
    }  # fmt: skip


def test_concurrent_python_calls_each_get_their_own_answer(python_env):
    answers: dict[int, str] = {}

    def call(i: int) -> None:
        code = f"import time\ntime.sleep(0.2)\nprint({i} * {i})"
        answers[i] = step(python_env, "python", tool("python", code))["observation"]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == {i: f"{i * i}\n" for i in range(4)}
