"""The command line without a model: help says where the files are without importing the engine or the UI;
paths prints each location."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parent.parent


def run(*args, **env):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env={**os.environ, **env},
                          timeout=60)


def test_help_names_the_real_file_locations(tmp_path):
    result = run("-m", "tuichat", "--help", TUICHAT_DATA_DIR=str(tmp_path / "hist"),
                 TUICHAT_CONFIG_DIR=str(tmp_path / "conf"))
    assert result.returncode == 0
    assert f"{tmp_path / 'hist'}/history.sqlite3" in result.stdout
    assert f"{tmp_path / 'conf'}/config.toml" in result.stdout


def test_help_stays_light():
    code = (
        "import sys\nfrom tuichat.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(name for name in ('torch', 'transformers', 'textual') if name in sys.modules))"
    )
    result = run("-c", code)
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "[]"


def test_bench_help_names_every_scenario_and_peer():
    from click.testing import CliRunner

    from tuichat.bench.settings import PEERS, SCENARIOS
    from tuichat.cli import main

    text = "".join(CliRunner().invoke(main, ["bench", "--help"]).output.split())  # whatever click wrapped
    assert ",".join(SCENARIOS) in text and ",".join(PEERS) in text


def test_paths_prints_every_location(tmp_path):
    result = run("-m", "tuichat", "paths", TUICHAT_CONFIG_DIR=str(tmp_path / "conf"),
                 TUICHAT_DATA_DIR=str(tmp_path / "hist"), TUICHAT_CACHE_DIR=str(tmp_path / "c"))
    assert result.returncode == 0
    printed = dict(line.split(":", 1) for line in result.stdout.splitlines())
    assert {name: value.strip() for name, value in printed.items()} == {
        "config": str(tmp_path / "conf" / "config.toml"),
        "themes": str(tmp_path / "conf" / "themes"),
        "bundled": str(CHECKOUT / "tuichat" / "themes"),
        "history": str(tmp_path / "hist" / "history.sqlite3"),
        "cache": str(tmp_path / "c"),
        "kv": str(tmp_path / "c" / "kv"),
    }


def ask(tmp_path, *args: str | bytes, stdin: bytes | None = None, **env) -> subprocess.CompletedProcess:
    """`tuichat ask` in a fresh process with bytes in and out, as a shell would run it."""
    env = {**os.environ, "TUICHAT_CONFIG_DIR": str(tmp_path / "config"), "TUICHAT_DATA_DIR": str(tmp_path / "data"),
           "TUICHAT_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(tmp_path / "home"), **env}
    return subprocess.run([sys.executable, "-m", "tuichat", "ask", *args], input=stdin, capture_output=True,
                          env=env, cwd=CHECKOUT, timeout=120)


def one_clear_line(result: subprocess.CompletedProcess) -> str:
    """The exit code 2 and the single `tuichat: ...` line on stderr that every refusal gives, and nothing else."""
    stderr = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 2, stderr
    assert result.stdout == b""
    assert "Traceback" not in stderr and len(stderr.splitlines()) == 1 and stderr.startswith("tuichat: "), stderr
    return stderr


def nothing_loaded(tmp_path) -> bool:
    """No model converted: the first load converts into a folder of cache/models (its hash index, a file
    there, may be written before the load is refused)."""
    models = tmp_path / "cache" / "models"
    return not models.exists() or not any(path.is_dir() for path in models.iterdir())


@pytest.mark.parametrize("encoding", [None, "utf-8:strict"])  # stdin's errors are surrogateescape or strict by locale
def test_ask_with_invalid_utf8_on_stdin_says_where_and_sends_nothing(tmp_path, encoding):
    env = {"PYTHONIOENCODING": encoding} if encoding else {}
    result = ask(tmp_path, "-", stdin=b"Why is the sky blue?" + b" \xff\xfe", **env)
    assert "the prompt on stdin is not valid UTF-8 (byte 0xff at 21)" in one_clear_line(result)
    assert nothing_loaded(tmp_path)


@pytest.mark.parametrize("args, message", [
    ([os.fsencode("caf") + b"\xe9 au lait"], "the prompt is not valid UTF-8 (byte 0xe9 at 3)"),
    (["hi", "--system", b"\xc3("], "--system is not valid UTF-8 (byte 0xc3 at 0)"),
])
def test_ask_with_invalid_utf8_in_argv_says_where_and_sends_nothing(tmp_path, args, message):
    assert message in one_clear_line(ask(tmp_path, *args))
    assert nothing_loaded(tmp_path)


@pytest.mark.parametrize("args, message", [
    # A valid non-ASCII prompt passes the check: the model spec is what fails.
    (["Qu'est-ce que c'est ?", "--model", "./no/such/dir"], "No such file or folder: ./no/such/dir"),
    (["hi", "--model", "~/x"], "No such file or folder: {home}/x"),
    (["hi", "--model", "no/such/dir"], "No such file or folder: no/such/dir"),
    (["hi", "--model", "/no/such/model.gguf"], "No such file or folder: /no/such/model.gguf"),
    (["hi", "--model", "someorg/not-cached"], "is not in the Hugging Face cache ({hf}) and HF_HUB_OFFLINE is set"),
    (["hi", "--model", "nonsense"], "Unknown model 'nonsense'"),
    (["hi", "--seed", "-1"], "seed must be a whole number from 0 to 2**64 - 1, or unset, not -1."),
])
def test_ask_with_a_bad_model_or_setting_is_one_clear_line(tmp_path, args, message):
    result = ask(tmp_path, *args, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hf"))
    assert message.format(home=tmp_path / "home", hf=tmp_path / "hf") in one_clear_line(result)
    assert nothing_loaded(tmp_path)


@pytest.mark.parametrize("device, message", [
    ("tpu", "Unknown device 'tpu': use auto, cpu"),
    ("cuda:x", "Unknown device 'cuda:x': use auto, cpu"),
    ("meta", "Unknown device 'meta': use auto, cpu"),
    ("mps", "--device mps is not available here: use auto, cpu"),
])
def test_ask_on_a_device_torch_cannot_use_is_one_clear_line(tmp_path, device, message):
    assert message in one_clear_line(ask(tmp_path, "hi", "--device", device, TUICHAT_CPU_KERNELS="0"))
    assert nothing_loaded(tmp_path)


def test_ask_on_a_gpu_index_beyond_the_gpus_lists_the_ones_there(tmp_path, monkeypatch):
    """One GPU, as torch would report it, and --device cuda:7 (in process, to fake the GPU count)."""
    import torch
    from click.testing import CliRunner

    from tuichat.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(tmp_path / "cache"))
    result = CliRunner().invoke(main, ["ask", "hi", "--device", "cuda:7"])
    assert result.exit_code == 2, result.output
    assert result.stderr == ("tuichat: --device cuda:7 is not available here: use auto, cpu, cuda, cuda:0 "
                             "(torch sees 1 CUDA GPU).\n")
    assert nothing_loaded(tmp_path)


def embedded_gguf() -> Path:
    from tuichat.catalog import embedded_gguf

    return embedded_gguf()


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_ask_on_a_truncated_or_corrupt_gguf_is_one_clear_line(tmp_path, damage):
    original = embedded_gguf()
    broken = tmp_path / "downloads" / "model.gguf"
    broken.parent.mkdir()
    if damage == "truncated":  # an interrupted download: the header whole, the tensors cut off
        with original.open("rb") as source:
            broken.write_bytes(source.read(50_000_000))
        expected = (f"{broken} is truncated or corrupt: its tensors need {original.stat().st_size:,} bytes, "
                    "the file has 50,000,000.")
    else:
        broken.write_bytes(bytes(range(256)) * 4096)
        expected = f"{broken} is truncated or corrupt: it does not read as GGUF"
    result = ask(tmp_path, "hi", "--model", str(broken), "--dtype", "float32", TUICHAT_CPU_KERNELS="0")
    assert expected in one_clear_line(result)
    assert nothing_loaded(tmp_path)  # not even in part


def test_ask_shows_one_progress_display_ours_through_a_conversion_and_a_load(tmp_path):
    """A fresh cache: a GGUF (a tiny one: the embedded model's conversion takes half a minute) is converted,
    then loaded. transformers' own tqdm bars ("Loading weights", "Writing model shards") would sit between our
    lines; only ours, and the stats line, may be there."""
    from tests.tiny_gguf import write_gguf

    write_gguf(tmp_path / "tiny.gguf", chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    result = ask(tmp_path, "Hi", "--model", str(tmp_path / "tiny.gguf"), "--max-tokens", "4", "--dtype", "float32",
                 TUICHAT_CPU_KERNELS="0")
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    lines = stderr.splitlines()
    assert "\r" not in stderr and "it/s" not in stderr and "█" not in stderr, stderr
    assert all(line.startswith(("[tuichat] ", "tuichat: ")) for line in lines[:-1]), stderr
    assert lines[-1].startswith("[tiny.gguf · cpu float32] TTFT"), stderr
    stages = [line for line in lines if line.startswith("[tuichat] ")]
    assert any("Dequantizing" in line for line in stages) and any("Converted" in line for line in stages)
    assert stages[-1] == "[tuichat] Loaded tiny.gguf"


def test_transformers_progress_switch_is_restored_after_a_load(tmp_path):
    """The bars are off only while tuichat loads: transformers and the hub show them again afterwards."""
    import torch
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as hf_logging

    from tests.helpers import make_tiny
    from tuichat.catalog import resolve
    from tuichat.engine import loader

    make_tiny()[0].save_pretrained(tmp_path / "tiny")
    loader.load(resolve(str(tmp_path / "tiny")), torch.device("cpu"), torch.float32, with_tokenizer=False)
    assert hf_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()
