import json
import re
from dataclasses import fields

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tuichat.backends.protocol import EngineOptions, SamplingParams, TuichatError
from tuichat.config import DEFAULT_CONFIG_TOML, Config, config_path, load_config


@pytest.fixture
def config_dir(user_dirs):
    return user_dirs.config


def load(tmp_path, text):
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    return load_config(path)


def test_missing_file_gives_defaults_and_writes_the_template(config_dir):
    config, warnings = load_config()
    assert config == Config()
    assert warnings == []
    assert config_path() == config_dir / "config.toml"
    assert config_path().read_text(encoding="utf-8") == DEFAULT_CONFIG_TOML
    # The template as written changes nothing.
    assert load_config() == (Config(), [])


def test_template_documents_every_setting_with_a_valid_example(tmp_path):
    uncommented = re.sub(r"(?m)^# (\"?[\w-]+\"? = .*)$", r"\1", DEFAULT_CONFIG_TOML)
    config, warnings = load(tmp_path, uncommented)
    assert warnings == []
    documented = set(re.findall(r"(?m)^# ([\w]+) = ", DEFAULT_CONFIG_TOML))
    top_level = {f.name for f in fields(Config)} - {"sampling", "engine", "keymap"}
    assert documented == top_level | {f.name for f in fields(SamplingParams)} | {f.name for f in fields(EngineOptions)}
    # Every example differs from the default where the default is "unset", so each line was really applied.
    assert config.system_prompt and config.models and config.keymap
    assert config.sampling.get("seed") is not None and config.sampling["stop"] == ("\nUser:",)
    assert config.engine.kv_cache_mb and config.engine.max_batched_tokens and config.engine.device_map == "auto"


def test_every_setting_is_applied(tmp_path):
    config, warnings = load(
        tmp_path,
        """
model = "qwen2.5-0.5b"
system_prompt = "Be brief."
theme = "tuichat-light"
models = ["a", "b/c"]

[sampling]
temperature = 1
top_p = 0.9
top_k = 40
max_tokens = 64
seed = 7
stop = ["###"]

[engine]
device = "cuda:1"
dtype = "bfloat16"
kv_cache_mb = 256
batching = "static"
prefix_cache = false
max_batched_tokens = 1024
max_num_seqs = 8
tp = 2
device_map = "auto"
quant = "int8"

[keymap]
send = "ctrl+s"
"quit.app" = "ctrl+q,f10"
tabs.next = "ctrl+right"
""",
    )
    assert warnings == []
    assert config == Config(
        model="qwen2.5-0.5b",
        system_prompt="Be brief.",
        theme="tuichat-light",
        models=["a", "b/c"],
        sampling=dict(temperature=1.0, top_p=0.9, top_k=40, max_tokens=64, seed=7, stop=("###",)),
        engine=EngineOptions(
            device="cuda:1",
            dtype="bfloat16",
            kv_cache_mb=256,
            batching="static",
            prefix_cache=False,
            max_batched_tokens=1024,
            max_num_seqs=8,
            tp=2,
            device_map="auto",
            quant="int8",
        ),
        keymap={"send": "ctrl+s", "quit.app": "ctrl+q,f10", "tabs.next": "ctrl+right"},
    )
    assert isinstance(config.sampling["temperature"], float)


def test_syntax_error_gives_defaults_and_one_warning_with_file_and_line(tmp_path):
    config, warnings = load(tmp_path, 'model = "x"\n\n[sampling\ntemperature = 1\n')
    assert config == Config()
    assert len(warnings) == 1
    assert str(tmp_path / "config.toml") in warnings[0] and "line 3" in warnings[0]


def test_each_bad_setting_is_ignored_with_one_warning_and_the_rest_applies(tmp_path):
    config, warnings = load(
        tmp_path,
        """
model = "kept"
colour = "blue"
[sampling]
temperature = "hot"
max_tokens = -5
top_p = 0
top_k = 3
[engine]
batching = "fast"
tp = true
device = "gpu"
dtype = "float16"
[keymap]
send = 3
quit = "ctrl+q"
""",
    )
    assert config.model == "kept"
    assert config.sampling == {"top_k": 3}
    assert config.engine == EngineOptions(dtype="float16")
    assert config.keymap == {"quit": "ctrl+q"}
    bad = ["colour", "sampling.temperature", "sampling.max_tokens", "sampling.top_p", "engine.batching", "engine.tp",
           "engine.device", "keymap.send"]
    assert len(warnings) == len(bad)
    for key, warning in zip(sorted(bad), sorted(warnings, key=lambda w: re.search(r'"([\w.]+)"', w).group(1))):
        assert f'"{key}"' in warning
        assert str(tmp_path / "config.toml") in warning
    assert any('"hot"' in w for w in warnings)  # the offending value is quoted back


def test_hints_for_typos_and_misplaced_keys(tmp_path):
    _, warnings = load(tmp_path, "temperature = 0.5\n[sampling]\ntemprature = 0.5\n[engin]\n")
    assert len(warnings) == 3
    misplaced, typo_table, typo_key = sorted(warnings, key=lambda w: ("[sampling]" not in w, "engin" not in w))
    assert '"temperature"' in misplaced and "under [sampling]" in misplaced
    assert '"engin"' in typo_table and '"engine"' in typo_table
    assert '"sampling.temprature"' in typo_key and '"sampling.temperature"' in typo_key


def test_a_table_of_the_wrong_type_is_ignored(tmp_path):
    config, warnings = load(tmp_path, 'sampling = 3\nengine = "cpu"\nmodel = "m"\n')
    assert config == Config(model="m")
    sampling, engine = sorted(warnings, key=lambda w: '"engine"' in w)
    assert '"sampling" must be a [sampling] table, not 3' in sampling
    assert '"engine" must be a [engine] table, not "cpu"' in engine


def test_empty_system_prompt_means_none(tmp_path):
    config, warnings = load(tmp_path, 'system_prompt = ""\n')
    assert config.system_prompt is None and warnings == []


def test_unreadable_file_gives_defaults_and_a_warning(tmp_path):
    path = tmp_path / "config.toml"
    path.write_bytes(b"model = \"\xff\"\n")
    config, warnings = load_config(path)
    assert config == Config()
    [warning] = warnings
    assert str(path) in warning and "cannot be read" in warning and "utf-8" in warning


@pytest.mark.parametrize(
    "given, named",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.0), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(seed=1.5), "seed"),
        (dict(seed="7"), "seed"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(stop="###"), "stop"),  # a string would be taken as its characters
        (dict(stop=("ok", 3)), "stop"),
    ],
)
def test_sampling_params_reject_bad_values_with_a_message_naming_them(given, named):
    with pytest.raises(TuichatError, match=rf"^{named} must be .*, not {re.escape(repr(next(iter(given.values()))))}\.$"):
        SamplingParams(**given)


def test_sampling_params_accept_the_edges_and_name_every_bad_value():
    SamplingParams(temperature=0, top_p=1, top_k=0, max_tokens=1, seed=0, stop=("", "x"))
    SamplingParams(temperature=2.5, top_p=1e-9, seed=2**64 - 1)
    with pytest.raises(TuichatError) as error:
        SamplingParams(top_p=0, max_tokens=0)
    assert "top_p" in str(error.value) and "max_tokens" in str(error.value)


@pytest.mark.parametrize("line", ["temperature = nan", "temperature = -inf", "top_p = 0", "top_p = inf",
                                  "top_k = -1", "max_tokens = 0", "seed = -1", "seed = 1.5", 'stop = "###"'])
def test_a_sampling_value_the_params_reject_is_a_warning_and_the_default(tmp_path, line):
    config, warnings = load(tmp_path, f"[sampling]\n{line}\n")
    assert config.sampling == {}
    assert len(warnings) == 1 and f'"sampling.{line.split()[0]}"' in warnings[0] and "using the default" in warnings[0]


# No control characters or lone surrogates: TOML forbids them even escaped, and this test is about values.
text = st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=8)
toml_values = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),  # nan and inf too: TOML has them, and the sampler must never see them
    text,
    st.sampled_from(["auto", "cpu", "cuda:0", "static", "off", "float16", "balanced"]),
    st.lists(st.one_of(text, st.integers(-5, 5)), max_size=3),
)


def toml(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)  # such JSON strings and integers are valid TOML


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sampling=st.dictionaries(st.sampled_from([f.name for f in fields(SamplingParams)]), toml_values),
    engine=st.dictionaries(st.sampled_from([f.name for f in fields(EngineOptions)]), toml_values),
)
def test_any_values_never_raise_and_each_setting_is_applied_or_warned(tmp_path, sampling, engine):
    text = "[sampling]\n" + "".join(f"{k} = {toml(v)}\n" for k, v in sampling.items())
    text += "[engine]\n" + "".join(f"{k} = {toml(v)}\n" for k, v in engine.items())
    config, warnings = load(tmp_path, text)
    assert not any("not valid TOML" in w for w in warnings)
    # The [sampling] the user wrote is kept as given (a setting warned about is left out); the engine options
    # are whole, a warned one at its default.
    chosen = SamplingParams(**config.sampling)
    for table, values, result, default in [
        ("sampling", sampling, chosen, SamplingParams()),
        ("engine", engine, config.engine, EngineOptions()),
    ]:
        for key, value in values.items():
            warned = [w for w in warnings if f'"{table}.{key}"' in w]
            if warned:
                assert len(warned) == 1
                assert getattr(result, key) == getattr(default, key)
                assert table == "engine" or key not in config.sampling
            else:
                applied = tuple(value) if key == "stop" else value
                if isinstance(getattr(default, key), float):  # a whole number is read as a float: 2**53 + 1 rounds
                    applied = float(value)
                assert getattr(result, key) == applied
