"""The first hour on a fresh machine: the system check before `make run` / `make test`, a router
that starts without torch and tokenizes as transformers does, Ctrl-C on `pdserve up` without a
traceback, and a bench that never scans the filesystem for libtcmalloc."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from engine.processor import TokenizerCodec, load_light_tokenizer
from services.router.errors import RouterError
from services.router.served_model import ServedModel
from service_procs import poll_until  # tests/services is on sys.path (tests/conftest.py)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM_DEPS = os.path.join(REPO, "scripts", "system-deps.sh")

# A template that uses what chat templates on the Hub use: special tokens, namespace, loop
# controls, raise_exception, tojson, {% generation %}, reasoning fields, template kwargs.
RICH_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(systems=0) %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% if message['role'] == 'system' %}{% set ns.systems = ns.systems + 1 %}{% continue %}{% endif %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message.name is defined %}({{ message.name }}){% endif %}"
    "{% if message.reasoning_content is defined %}[{{ message.reasoning_content }}]{% endif %}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}{{ eos_token }}"
    "{% endgeneration %}{% else %}{{ message['content'] }}{% endif %}\n"
    "{% if message.meta is defined %}{{ message.meta | tojson }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    "{% if ns.systems %}({{ ns.systems }} system){% endif %}{% if greeting is defined %}{{ greeting }}{% endif %}")

CHATS = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}], True, False, {}),
    ([{"role": "user", "content": "caf\u00e9 \u65e5\u672c", "name": None, "meta": {"k": "\u00e9"}},
      {"role": "assistant", "content": " The old king ", "reasoning": "think"}], False, False, {}),
    ([{"role": "user", "content": "Tell"}, {"role": "assistant", "content": "The old"}], False, True, {}),
    ([{"role": "user", "content": "x", "name": "bob"}], True, False, {"greeting": "h\u00e9llo"}),
]
TEXTS = ["Hello world", "  two leading spaces", "new\nline\ttab", "1234567", "caf\u00e9 \u65e5\u672c\u8a9e \U0001f642",
         "<s> x </s>", "<|user|>\nThe old king<|assistant|>", "</s></s>", ""]


@pytest.fixture(scope="module")
def rich_checkpoint(tiny_llama, tmp_path_factory):
    """The tiny checkpoint with its template in tokenizer_config.json (no chat_template.jinja) and
    a post-processor that adds BOS, as Llama checkpoints have."""
    path = str(tmp_path_factory.mktemp("tiny-rich") / "ckpt")
    shutil.copytree(tiny_llama, path)
    os.remove(os.path.join(path, "chat_template.jinja"))
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["chat_template"] = RICH_TEMPLATE
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "tokenizer.json")) as f:
        tok = json.load(f)
    bos = next(t for t in tok["added_tokens"] if t["content"] == "<s>")
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [bos["id"]], "tokens": ["<s>"]}}}
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    return path


@pytest.mark.parametrize("which", ["as saved", "rich"])
def test_tokenizer_codec_matches_transformers(which, tiny_llama, rich_checkpoint):
    from transformers import AutoTokenizer

    path = tiny_llama if which == "as saved" else rich_checkpoint
    hf = AutoTokenizer.from_pretrained(path)
    codec = load_light_tokenizer(path)
    assert isinstance(codec, TokenizerCodec)
    assert len(codec) == len(hf) and codec.eos_token_id == hf.eos_token_id
    assert codec.special_tokens_map == hf.special_tokens_map
    for text in TEXTS:
        for add in (True, False):
            ids = hf.encode(text, add_special_tokens=add)
            assert codec.encode(text, add_special_tokens=add) == ids, (text, add)
            for skip in (True, False):
                assert codec.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    if which == "rich":
        assert codec.encode("x")[0] == hf.bos_token_id  # the post-processor is honoured

    light, heavy = ServedModel(path, "m"), ServedModel(path, "m", tokenizer=hf)
    assert light.vocab_size == heavy.vocab_size
    for messages, add_generation_prompt, continue_final, kwargs in CHATS:
        args = (messages, add_generation_prompt, continue_final, kwargs)
        assert (codec.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final, **kwargs)
                == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final, **kwargs))
        assert light.encode(light.chat_text(*args), False) == heavy.encode(heavy.chat_text(*args), False)
    for served in (light, heavy) if which == "rich" else ():  # the template's own error, as a 400
        with pytest.raises(RouterError, match="unknown role tool") as e:
            served.chat_text([{"role": "tool", "content": "x"}], True, False, {})
        assert e.value.status == 400


def test_router_loads_and_tokenizes_without_torch(tiny_llama):
    """`pdserve router`'s imports, its model (tokenizer, chat template) and detokenization: no
    torch, no transformers (they cost the router seconds of start-up)."""
    code = textwrap.dedent(f"""
        import sys
        from services.cli import build_parser
        build_parser()
        import services.router.server
        from engine.detokenizer import IncrementalDetokenizer
        from engine.request import SamplingParams
        from services.router.served_model import ServedModel

        model = ServedModel({tiny_llama!r}, "tiny")
        ids = model.encode(model.chat_text([{{"role": "user", "content": "Hello"}}], True, False, {{}}), False)
        detok = IncrementalDetokenizer(model.codec, SamplingParams())
        assert model.decode(model.encode("The old king")) == "The old king" and ids
        print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
        """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _fake_bin(tmp_path, uid: int, present=()) -> dict:
    """A PATH with a fake `id`, a fake apt-get that only records its calls, and the given tools."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {"id": f"echo {uid}", "apt-get": f'echo "$@" >> {tmp_path / "apt.log"}',
               **{tool: "true" for tool in present}}
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return dict(os.environ, PATH=str(bin_dir), PYTHON=sys.executable, VENV=str(tmp_path / "venv"))


def test_system_check_names_the_command_and_runs_nothing(tmp_path):
    env = _fake_bin(tmp_path, uid=1000)
    out = subprocess.run(["/bin/bash", SYSTEM_DEPS, "prometheus"], env=env, capture_output=True, text=True)
    assert out.returncode == 1
    assert "sudo apt-get update && sudo apt-get install -y -q --no-install-recommends g++" in out.stderr
    assert "prometheus" in out.stderr.splitlines()[-1]
    assert not (tmp_path / "apt.log").exists()


def test_system_check_installs_as_root_then_checks_again(tmp_path):
    env = _fake_bin(tmp_path, uid=0)
    out = subprocess.run(["/bin/bash", SYSTEM_DEPS, "prometheus"], env=env, capture_output=True, text=True)
    calls = (tmp_path / "apt.log").read_text().splitlines()
    assert calls[0] == "update -q"
    assert calls[1].startswith("install -y -q --no-install-recommends g++") and "prometheus" in calls[1].split()
    assert out.returncode == 1 and "still missing after apt-get: g++" in out.stderr  # the fake installs nothing


def test_system_check_passes_quietly_when_everything_is_there(tmp_path):
    env = _fake_bin(tmp_path, uid=1000, present=("g++", "prometheus"))
    out = subprocess.run(["/bin/bash", SYSTEM_DEPS, "prometheus"], env=env, capture_output=True, text=True)
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")


def _up_serving(model: str, *argv: str) -> tuple[subprocess.Popen, list[str]]:
    """`pdserve up` started in a session of its own, its output read until it says it serves."""
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--model", model, "--port", "0", *argv],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "serving; Ctrl-C to stop" in line or "Traceback" in line:
                break
        assert lines and "serving; Ctrl-C to stop" in lines[-1], "".join(lines[-30:])
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc, lines


def test_ctrl_c_on_pdserve_up_prints_no_traceback(tiny_model_factory):
    """Ctrl-C reaches the terminal's whole process group; here every process of the stack gets
    SIGINT, as if each shared it (the launcher's children are in groups of their own)."""
    model = tiny_model_factory("llama", max_position_embeddings=512)
    proc, lines = _up_serving(model)
    try:
        stack = _descendants(proc.pid)
        assert len(stack) >= 5, "router, prefill, decode and their engine cores"
        os.killpg(proc.pid, signal.SIGINT)
        for pid in stack:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
        rest = proc.stdout.read()
        assert proc.wait(60) == 0, rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
    assert "stack stopped" in rest
    poll_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in stack), 15, interval=0.2)
    assert not [pid for pid in stack if os.path.exists(f"/proc/{pid}")], "processes outlived `pdserve up`"


def test_pdserve_up_reaches_a_router_behind_https_and_an_api_key(tiny_model_factory, tmp_path):
    """`up` passes the router its flags (--router-arg) and reaches it as they say: readiness over
    HTTPS, the demo request with the API key, the URL and curl line announced as https."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "server.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    model = tiny_model_factory("llama", max_position_embeddings=512)
    proc, lines = _up_serving(model, "--demo", f"--router-arg=--ssl-certfile={tmp_path / 'server.pem'}",
                              f"--router-arg=--ssl-keyfile={tmp_path / 'server.key'}", "--router-arg=--api-key=k1")
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(60)
    out = "".join(lines)
    assert "pdserve is serving at https://127.0.0.1:" in out
    assert f"curl --cacert {tmp_path / 'server.pem'} -H 'Authorization: Bearer <your --api-key>' https://" in out
    demo = next(line for line in lines if line.startswith("demo completion (streamed): The old king"))
    assert len(demo.strip()) > len("demo completion (streamed): The old king") + 5, demo
    assert "a request to the router failed" not in out and "k1" not in out


def test_up_reads_the_routers_tls_and_key_from_its_flags_or_environment(monkeypatch):
    from services.launcher import RouterFront

    def front(*router_args: str) -> RouterFront:  # the router's command line as `up` writes it
        return RouterFront.from_router_argv(["router", "--model", "m", "--decode", "127.0.0.1:1", *router_args])

    plain = front("--reasoning-parser=qwen3")
    assert (plain.scheme, plain.context, plain.headers) == ("http", None, {})
    tls = front("--ssl-certfile", "c.pem", "--ssl-keyfile=k.pem", "--api-key", "a", "b")
    assert tls.scheme == "https" and tls.context is not None and tls.headers == {"Authorization": "Bearer a"}
    assert not tls.client_certs_required
    for name, value in (("PDSERVE_ROUTER_SSL_CERTFILE", "c.pem"), ("PDSERVE_ROUTER_SSL_CERT_REQS", "2"),
                        ("PDSERVE_API_KEY", "x,y")):
        monkeypatch.setenv(name, value)
    env = front()
    assert env.scheme == "https" and env.client_certs_required and env.api_key == "x"
    monkeypatch.setenv("PDSERVE_ROUTER_SSL_CERT_REQS", "two")  # the router refuses it; `up` reports its exit
    assert front() == RouterFront()


def _descendants(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    children.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return children + [d for c in children for d in _descendants(c)]
