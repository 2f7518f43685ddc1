"""Model configuration on its own: config.pbtxt in each of the spellings Triton's files use, the
defaults auto-completion fills, and the error text for each configuration Triton refuses (each
names the model and the field). Model folders are made under tmp_path."""
from __future__ import annotations

from pathlib import Path

import pytest

from shmserve.config_view import to_dict
from shmserve.server.broker import config as cfgmod
from shmserve.server.broker.config import ConfigError, mc
from shmserve.server.broker.ensemble_plan import find_cycle
from shmserve.workers.devices import cuda_device_count

BACKENDS = {"python", "pytorch"}


def parse(text: str, model: str = "m") -> mc.ModelConfig:
    return cfgmod.parse_config_text(text, model)


def model_dir(root: Path, name: str = "m", config: str | None = None, files: dict[str, str] | None = None) -> Path:
    """A model folder: config.pbtxt (if given) and files by their path inside it."""
    d = root / name
    d.mkdir()
    if config is not None:
        (d / "config.pbtxt").write_text(config)
    for rel, text in (files or {}).items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


def check(text: str, root: Path, files: dict[str, str] | None = None, name: str = "m") -> mc.ModelConfig:
    """Load and validate as the broker does, the model files of version 1 present by default."""
    d = model_dir(root, name, text, files if files is not None else {"1/model.py": ""})
    config = cfgmod.load_config(d, strict=True)
    available = cfgmod.version_dirs(d)
    cfgmod.validate(config, d, BACKENDS, cfgmod.select_versions(config, available))
    return config


# -- config.pbtxt syntax --------------------------------------------------------------------------

TENSOR = 'name: "X" data_type: TYPE_FP32 dims: [ -1, 3 ]'


@pytest.mark.parametrize("text", [
    f'input [ {{ {TENSOR} }}, {{ name: "Y" data_type: TYPE_INT64 dims: [ 1 ] }} ]',  # a list
    f'input {{ {TENSOR} }} input {{ name: "Y" data_type: TYPE_INT64 dims: [ 1 ] }}',  # repeated fields
    f'input: [ {{ {TENSOR} }}, {{ name: "Y" data_type: TYPE_INT64 dims: 1 }} ]',  # colon; one dim bare
    'input < name: "X" data_type: TYPE_FP32 dims: -1 dims: 3 >, input < name: "Y", data_type: 9, dims: [1] >;',
    "# a comment\ninput [ { name: 'X' # names in single quotes\n data_type: TYPE_FP32 dims: [ -1, 3 ] },\n"
    "  { name: \"Y\"; data_type: TYPE_INT64; dims: [ 1 ] } ]",
])
def test_every_spelling_of_a_list_of_tensors_parses_alike(text):
    config = parse(text)
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == \
        [("X", mc.TYPE_FP32, [-1, 3]), ("Y", mc.TYPE_INT64, [1])]


def test_a_full_config_as_triton_writes_it():
    config = parse('''
        name: "full"
        platform: "pytorch_libtorch"
        max_batch_size: 8
        version_policy: { specific: { versions: [1, 3] } }
        instance_group [ { count: 2, kind: KIND_CPU }, { kind: KIND_MODEL } ]
        dynamic_batching {
          preferred_batch_size: [ 4, 8 ]
          max_queue_delay_microseconds: 100
          default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 5 }
        }
        parameters { key: "execution_timeout_s" value: { string_value: "2.5" } }
        parameters: [ { key: "canary_fraction", value: { string_value: "0.1" } } ]
        output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] label_filename: "labels.txt" } ]
        model_warmup [ { name: "w" batch_size: 1
                         inputs { key: "X" value { data_type: TYPE_FP32 dims: 3 zero_data: true } } } ]
    ''', "full")
    assert config.platform == "pytorch_libtorch" and cfgmod.backend_of(config) == "pytorch"
    assert list(config.version_policy.specific.versions) == [1, 3]
    assert [(g.count, g.kind) for g in config.instance_group] == [(2, mc.ModelInstanceGroup.KIND_CPU),
                                                                   (0, mc.ModelInstanceGroup.KIND_MODEL)]
    assert list(config.dynamic_batching.preferred_batch_size) == [4, 8]
    assert config.dynamic_batching.default_queue_policy.timeout_action == mc.ModelQueuePolicy.DELAY
    assert cfgmod.string_parameters(config) == {"execution_timeout_s": "2.5", "canary_fraction": "0.1"}
    assert config.output[0].label_filename == "labels.txt"
    assert config.model_warmup[0].inputs["X"].zero_data


@pytest.mark.parametrize("text, needle", [
    ("max_batch_size: 8\nbogus_field: 1",
     '2:1 : Message type "inference.ModelConfig" has no field named "bogus_field"'),
    ('input [ { name: "X" data_type: TYPE_FLOAT99 } ]', "TYPE_FLOAT99"),
    ("max_batch_size: eight", "max_batch_size"),
    ('input [ { name: "X" ', "1:"),  # unterminated
    ("dynamic_batching { } sequence_batching { }", 'Field "sequence_batching" is specified along with field '
                                                   '"dynamic_batching", another member of oneof "scheduling_choice"'),
])
def test_a_config_pbtxt_that_does_not_parse_names_the_model_file_and_position(text, needle):
    with pytest.raises(ConfigError) as e:
        parse(text, "broken")
    assert str(e.value).startswith("model 'broken': config.pbtxt: ")
    assert needle in str(e.value)


# -- loading and auto-completion --------------------------------------------------------------


def expected_kind() -> int:
    return mc.ModelInstanceGroup.KIND_GPU if cuda_device_count() else mc.ModelInstanceGroup.KIND_CPU


def test_a_model_without_config_pbtxt_is_completed_from_its_files(tmp_path):
    d = model_dir(tmp_path, "auto", files={"1/model.pt": "", "2/model.py": "", "notes/x": ""})
    config = cfgmod.load_config(d, strict=False)
    assert config.name == "auto"
    assert config.backend == "python"  # from the newest version's files
    assert config.version_policy.latest.num_versions == 1
    [group] = config.instance_group
    assert (group.name, group.count, group.kind) == ("auto", 1, expected_kind())  # named after the model, as Triton names it
    assert cfgmod.select_versions(config, cfgmod.version_dirs(d)) == [2]


@pytest.mark.parametrize("filename, backend", [("model.pt", "pytorch"), ("model.pt2", "pytorch"),
                                               ("model.onnx", "onnxruntime"), ("weights.bin", "")])
def test_the_backend_is_inferred_from_the_model_file(tmp_path, filename, backend):
    d = model_dir(tmp_path, files={f"1/{filename}": ""})
    assert cfgmod.load_config(d, strict=False).backend == backend


def test_a_platform_names_its_backend_and_completion_fills_each_instance_group(tmp_path):
    d = model_dir(tmp_path, config='platform: "pytorch_libtorch" '
                                   'instance_group [ { count: 0 }, { count: 3 kind: KIND_CPU } ]')
    config = cfgmod.load_config(d, strict=True)
    assert config.backend == "pytorch" and config.name == "m"
    assert [(g.name, g.count, g.kind) for g in config.instance_group] == [
        ("m_0", 1, expected_kind()), ("m_1", 3, mc.ModelInstanceGroup.KIND_CPU)]
    assert cfgmod.instance_count(config) == max(1, cuda_device_count()) + 3  # a GPU group: one per GPU


def test_strict_mode_needs_config_pbtxt_and_still_infers_the_backend(tmp_path):
    """Triton 2.51 with --disable-auto-complete-config serves a config.pbtxt that names no
    backend beside a model.py: its server-side completion of the backend always runs."""
    d = model_dir(tmp_path, files={"1/model.py": ""})
    with pytest.raises(ConfigError, match="^model 'm': config.pbtxt is missing and --strict-model-config is set$"):
        cfgmod.load_config(d, strict=True)
    d2 = model_dir(tmp_path, "m2", config="max_batch_size: 0", files={"1/model.py": ""})
    assert cfgmod.load_config(d2, strict=True).backend == "python"
    assert cfgmod.load_config(d2, strict=False).backend == "python"


def test_the_backend_is_inferred_as_triton_infers_it(tmp_path):
    """Triton tries ONNX before PyTorch before Python, and takes a ``default_model_filename`` it
    knows before any file."""
    d = model_dir(tmp_path, files={"1/model.py": "", "2/model.onnx": "", "2/model.py": ""})
    assert cfgmod.load_config(d, strict=False).backend == "onnxruntime"
    d2 = model_dir(tmp_path, "m2", config='default_model_filename: "model.py"', files={"1/model.onnx": ""})
    assert cfgmod.load_config(d2, strict=True).backend == "python"


def test_the_name_in_config_pbtxt_must_match_the_folder(tmp_path):
    d = model_dir(tmp_path, "right", config='name: "wrong"')
    with pytest.raises(ConfigError, match="^model 'right': name 'wrong' in config.pbtxt must match the model "
                                          "directory name 'right'$"):
        cfgmod.load_config(d, strict=False)


def test_a_config_override_replaces_the_file(tmp_path):
    d = model_dir(tmp_path, config='backend: "python" max_batch_size: 4')
    config = cfgmod.load_config(d, strict=True, override_json='{"backend": "python", "max_batch_size": 2}')
    assert config.max_batch_size == 2
    with pytest.raises(ConfigError, match="^model 'm': config override: "):
        cfgmod.load_config(d, strict=True, override_json='{"max_batch_size": "many"}')


def test_an_ensemble_gets_no_instance_groups(tmp_path):
    d = model_dir(tmp_path, config='platform: "ensemble"')
    config = cfgmod.load_config(d, strict=True)
    assert not config.instance_group and config.backend == "" and cfgmod.backend_of(config) == ""


def test_version_folders_are_numbers_in_numeric_order(tmp_path):
    d = model_dir(tmp_path, files={"10/a": "", "9/a": "", "2/a": "", "v3/a": "", ".4/a": "", "5": "a file",
                                   "007/a": "", "0/a": "", "warmup/a": ""})
    assert cfgmod.version_dirs(d) == [0, 2, 9, 10]  # ('007' is no version 7 to Triton)
    assert cfgmod.version_dirs(tmp_path / "absent") == []
    # warned about at load, as Triton does; hidden ones and Triton's own folders (warmup/) not
    assert cfgmod.non_version_dirs(d) == ["007", "v3"]


@pytest.mark.parametrize("policy, expected", [
    ("", [10]),
    ("version_policy { latest { num_versions: 2 } }", [9, 10]),
    ("version_policy { latest { num_versions: 9 } }", [2, 9, 10]),
    ("version_policy { all { } }", [2, 9, 10]),
    ("version_policy { specific { versions: [ 10, 2, 7, 2 ] } }", [2, 10]),
])
def test_version_policy_selects_versions(policy, expected):
    config = parse(policy)
    cfgmod.complete_defaults(config)
    assert cfgmod.select_versions(config, [2, 9, 10]) == expected
    assert cfgmod.select_versions(config, []) == []


@pytest.mark.parametrize("batcher, idle_us", [("sequence_batching { }", 1_000_000),
                                              ("sequence_batching { oldest { } }", 1_000_000),
                                              ("sequence_batching { max_sequence_idle_microseconds: 7 }", 7)])
def test_a_sequence_batcher_shows_tritons_default_idle_time(batcher, idle_us):
    """Triton fills max_sequence_idle_microseconds (1 s) when it is unset; the config endpoints
    then show it, where 0 read as "never idle"."""
    config = parse(batcher)
    cfgmod.complete_defaults(config)
    assert config.sequence_batching.max_sequence_idle_microseconds == idle_us


# -- validation: Triton's refusals, with the model and field named -------------------------------

GOOD_INPUT = 'input [ { name: "X" data_type: TYPE_FP32 dims: [ 3 ] } ]'


def test_a_good_config_passes(tmp_path):
    config = check(f'backend: "python" max_batch_size: 4 dynamic_batching {{ preferred_batch_size: [ 2, 4 ] }} '
                   f'{GOOD_INPUT} output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }} ]', tmp_path)
    assert config.name == "m"
    auto = check('backend: "python" instance_group [ { kind: KIND_AUTO } ]', tmp_path, name="auto")
    assert auto.instance_group[0].kind == expected_kind()  # completion resolves KIND_AUTO before the check


@pytest.mark.parametrize("text, message", [
    ('default_model_filename: "net.bin"', "model 'm': must specify 'backend' or 'platform' (none could be inferred from the "
                          "model files)"),
    ('backend: "tensorrt"', "model 'm': unable to find backend 'tensorrt' (installed backends: python, pytorch)"),
    ('platform: "tensorflow_savedmodel"', "model 'm': unable to find backend 'tensorflow_savedmodel': platform "
                                          "'tensorflow_savedmodel' is not served by shmserve (its backends: python, "
                                          "pytorch)"),
    ('platform: "tensorrt_plan"', "model 'm': unable to find backend 'tensorrt_plan': platform 'tensorrt_plan' is "
                                  "not served by shmserve (its backends: python, pytorch)"),
    ('backend: "python" max_batch_size: -1', "model 'm': max_batch_size must be >= 0, got -1"),
    ('backend: "python" dynamic_batching { preferred_batch_size: [ 1 ] }',
     "model 'm': dynamic_batching.preferred_batch_size 1 must be between 1 and max_batch_size 0"),
    ('backend: "python" max_batch_size: 4 dynamic_batching { preferred_batch_size: [ 2, 8 ] }',
     "model 'm': dynamic_batching.preferred_batch_size 8 must be between 1 and max_batch_size 4"),
    ('backend: "python" max_batch_size: 4 dynamic_batching { preferred_batch_size: [ 0 ] }',
     "model 'm': dynamic_batching.preferred_batch_size 0 must be between 1 and max_batch_size 4"),
    ('backend: "python" input [ { data_type: TYPE_FP32 dims: [ 1 ] } ]', "model 'm': an input has no name"),
    ('backend: "python" output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }, '
     '{ name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]', "model 'm': output 'Y' is declared more than once"),
    ('backend: "python" input [ { name: "X" dims: [ 1 ] } ]', "model 'm': input 'X' must specify 'data_type'"),
    ('backend: "python" input [ { name: "X" data_type: TYPE_FP32 } ]', "model 'm': input 'X' must specify 'dims'"),
    ('backend: "python" max_batch_size: 4 input [ { name: "X" data_type: TYPE_FP32 dims: [ ] } ]',
     "model 'm': input 'X' must specify 'dims'"),
    ('platform: "python"', "unexpected platform type 'python' for m"),
    ('backend: "python" input [ { name: "X" data_type: TYPE_FP32 dims: [ 2, 0 ] } ]',
     "model 'm': input 'X' dims [2, 0]: each dimension must be >= 1, or -1 for a variable-size dimension"),
    ('backend: "python" output [ { name: "Y" data_type: TYPE_FP32 dims: [ -2 ] } ]',
     "model 'm': output 'Y' dims [-2]: each dimension"),
    ('backend: "python" default_model_filename: "net.py"',
     "model 'm': version 1: model file 'net.py' is missing in "),
    ('backend: "pytorch"', "model 'm': version 1: model file 'model.pt' is missing in "),
    # Triton's own texts for the priority levels (its ValidateModelConfig)
    ('backend: "python" max_batch_size: 4 dynamic_batching { priority_levels: 2 default_priority_level: 5 }',
     "default priority level must be in range [1, 2] for m"),
    ('backend: "python" max_batch_size: 4 dynamic_batching { priority_levels: 2 }',
     "default priority level must be in range [1, 2] for m"),
    ('backend: "python" max_batch_size: 4 dynamic_batching { priority_levels: 2 default_priority_level: 1 '
     'priority_queue_policy { key: 3 value { max_queue_size: 1 } } }',
     "priority queue policy must have priority level in range [1, 2] for m"),
    ('backend: "python" max_batch_size: 4 dynamic_batching { preserve_ordering: true priority_levels: 2 '
     'default_priority_level: 1 }', "Only one priority level is allowed when 'preserve_ordering' is true for m"),
    ('backend: "python" max_batch_size: 4 dynamic_batching { preserve_ordering: true default_queue_policy '
     '{ timeout_action: DELAY default_timeout_microseconds: 10 } }',
     "Queue policy can not have DELAY as timeout action when 'preserve_ordering' is true for m"),
])
def test_each_refused_config_says_what_to_fix(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        check(text, tmp_path)
    assert str(e.value).startswith(message)


def test_empty_dims_are_refused_even_with_a_batch_dimension_or_a_reshape(tmp_path):
    """Triton 2.51 refuses a tensor without dims whatever else it has (checked side by side for
    a batching model); a scalar per batch row is ``dims: [ 1 ] reshape { shape: [ ] }``."""
    for name, text in (("batching", 'backend: "python" max_batch_size: 2 input [ { name: "X" data_type: TYPE_FP32 } ]'),
                       ("reshaped", 'backend: "python" input [ { name: "X" data_type: TYPE_FP32 reshape { shape: [ ] } } ]')):
        with pytest.raises(ConfigError, match="input 'X' must specify 'dims'"):
            check(text, tmp_path, name=name)
    scalar = check('backend: "python" max_batch_size: 2 input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] '
                   'reshape { shape: [ ] } } ]', tmp_path, name="scalar")
    assert scalar.input[0].HasField("reshape")


def test_the_model_file_may_be_named_and_pytorch_accepts_model_pt2(tmp_path):
    named = check('backend: "python" default_model_filename: "net.py"', tmp_path, {"1/net.py": ""})
    exported = check('backend: "pytorch"', tmp_path, {"1/model.pt2": ""}, name="exported")
    assert (named.default_model_filename, exported.backend) == ("net.py", "pytorch")


def test_every_selected_version_needs_its_model_file(tmp_path):
    with pytest.raises(ConfigError, match="version 2: model file 'model.py' is missing"):
        check('backend: "python" version_policy { all { } }', tmp_path, {"1/model.py": "", "2/other.py": ""})


def test_gpu_instance_groups_need_an_existing_gpu(tmp_path):
    with pytest.raises(ConfigError) as e:
        check('backend: "python" instance_group [ { name: "g" kind: KIND_GPU gpus: [ 999 ] } ]', tmp_path)
    if cuda_device_count():
        assert str(e.value) == "model 'm': instance_group 'g' names GPU 999, which does not exist"
    else:
        assert str(e.value) == "model 'm': instance_group 'g' asks for KIND_GPU but CUDA is not available (no GPU found)"


def test_an_instance_group_kind_that_completion_did_not_resolve_is_refused(tmp_path):
    config = parse('name: "m" backend: "python" instance_group [ { name: "a" kind: KIND_AUTO } ]')
    with pytest.raises(ConfigError, match="^model 'm': instance_group 'a' kind KIND_AUTO is not supported$"):
        cfgmod.validate(config, tmp_path, BACKENDS, [])


ENSEMBLE_IO = 'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ] ' \
              'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]'


def ensemble(*steps: str) -> str:
    return f'platform: "ensemble" {ENSEMBLE_IO} ensemble_scheduling {{ {" ".join(steps)} }}'


def step(source: str, made: str, model: str = "a", version: int = -1) -> str:
    named = f'model_name: "{model}" ' if model else ""
    return (f'step {{ {named}model_version: {version} input_map {{ key: "x" value: "{source}" }} '
            f'output_map {{ key: "y" value: "{made}" }} }}')


@pytest.mark.parametrize("steps, message", [
    ((), "ensemble_scheduling must have at least one step"),
    ((step("NOPE", "OUT"),), "step 'a' needs tensor(s) ['NOPE'] that no ensemble input or earlier step provides"),
    ((step("IN", "MID"),), "ensemble output(s) ['OUT'] are not produced by any step"),
    ((step("IN", "OUT", model=""),), "every step must name a model_name"),
    # Triton's refusals of its data flow, in its words
    ((step("IN", "OUT"), step("IN", "OUT", model="b")),
     "ensemble tensor 'OUT' can appear in an output map only once for ensemble 'm' step 1"),
    ((step("IN", "OUT"), step("IN", "SPARE", model="b")), "ensemble tensor 'SPARE' is unused in ensemble 'm'"),
])
def test_an_ensemble_whose_steps_cannot_run_is_refused(tmp_path, steps, message):
    with pytest.raises(ConfigError) as e:
        check(ensemble(*steps), tmp_path, files={})
    assert str(e.value) == f"model 'm': ensemble_scheduling: {message}"


def test_an_ensemble_input_no_step_reads_is_refused_in_tritons_words(tmp_path):
    io = ENSEMBLE_IO.replace('input [ {', 'input [ { name: "UNREAD" data_type: TYPE_FP32 dims: [ 1 ] }, {')
    with pytest.raises(ConfigError) as e:
        check(f'platform: "ensemble" {io} ensemble_scheduling {{ {step("IN", "OUT")} }}', tmp_path, files={})
    assert str(e.value) == "model 'm': ensemble_scheduling: ensemble input 'UNREAD' for ensemble m' is not used"


def test_ensemble_steps_in_any_order_pass(tmp_path):
    config = check(ensemble(step("MID", "OUT", model="b"), step("IN", "MID", model="a", version=1)), tmp_path, files={})
    assert [s.model_name for s in config.ensemble_scheduling.step] == ["b", "a"]


@pytest.mark.parametrize("graph, start, message", [
    ({"a": ["b", "m"], "b": ["a"]}, "a", "a -> ... -> b -> a"),
    ({"s": ["s"]}, "s", "s -> ... -> s -> s"),
    ({"top": ["mid"], "mid": ["low", "m"], "low": ["top"]}, "top", "top -> ... -> low -> top"),
])
def test_ensembles_that_reach_themselves_are_named(graph, start, message):
    assert find_cycle(start, graph) == f"circular dependency between ensembles: {message}"


def test_ensembles_without_a_loop_through_them_pass():
    # "x" reaches a loop (a <-> b) that does not pass through it: a and b fail their own loads.
    assert find_cycle("x", {"x": ["a", "m"], "a": ["b"], "b": ["a"]}) is None
    assert find_cycle("x", {"x": ["y", "y"], "y": ["m"]}) is None  # a model named twice is no loop


# -- the dict form and parameters -------------------------------------------------------------


def test_the_dict_form_has_defaults_and_64_bit_integers_as_numbers():
    config = parse('name: "m" max_batch_size: 4 input [ { name: "X" data_type: TYPE_FP32 dims: [ -1, 3 ] } ] '
                   'dynamic_batching { max_queue_delay_microseconds: 100 priority_queue_policy { key: 1 value { '
                   'default_timeout_microseconds: 7 } } }')
    d = to_dict(config)
    assert d["input"][0]["dims"] == [-1, 3]  # int64: protobuf's JSON would write ["-1", "3"]
    assert d["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    assert d["dynamic_batching"]["priority_queue_policy"]["1"]["default_timeout_microseconds"] == 7
    assert d["platform"] == "" and d["input"][0]["data_type"] == "TYPE_FP32"  # defaults are written out
    assert "sequence_batching" not in d  # an unset message stays absent
    assert cfgmod.from_dict(d) == config
    assert cfgmod.from_dict({**d, "not_a_field": 1}) == config  # unknown fields are ignored


@pytest.mark.parametrize("raw, expected", [(None, 0.0), ("0", 0.0), ("2.5", 2.5)])
def test_execution_timeout_parameter(raw, expected):
    assert cfgmod.execution_timeout({} if raw is None else {"execution_timeout_s": raw}) == expected


@pytest.mark.parametrize("raw, message", [
    ("soon", "parameter 'execution_timeout_s' must be a number of seconds, got 'soon'"),
    ("-1", "parameter 'execution_timeout_s' must not be negative, got -1.0"),
])
def test_a_bad_execution_timeout_is_refused(raw, message):
    with pytest.raises(ValueError) as e:
        cfgmod.execution_timeout({"execution_timeout_s": raw})
    assert str(e.value) == message


# -- fields shmserve does not implement (server/broker/unsupported.py) -----------------------------


def test_every_unsupported_path_names_a_field_of_triton_schema():
    from shmserve.server.broker.unsupported import FIELDS

    for path in FIELDS:
        descriptor = mc.ModelConfig.DESCRIPTOR
        for part in path.split("."):
            assert descriptor is not None and part in descriptor.fields_by_name, path
            descriptor = descriptor.fields_by_name[part].message_type


def _schema_paths(descriptor, prefix: str = "", seen: frozenset = frozenset()) -> list[str]:
    """Every field path of Triton's ModelConfig (a map is one field; a message type already on the
    path is not entered again, e.g. a CUDA graph spec's lower bound)."""
    from google.protobuf.descriptor import FieldDescriptor

    out = []
    for field in descriptor.fields:
        path = prefix + field.name
        out.append(path)
        sub = field.message_type
        if field.type == FieldDescriptor.TYPE_MESSAGE and not sub.GetOptions().map_entry and sub.full_name not in seen:
            out += _schema_paths(sub, path + ".", seen | {sub.full_name})
    return out


def test_every_field_of_triton_schema_is_implemented_or_named_at_load():
    """A field of config.pbtxt is never ignored in silence: it is implemented, or it (or a message
    holding it) is in the table of fields warned about or refused by name."""
    from shmserve.server.broker.unsupported import FIELDS, IMPLEMENTED

    paths = _schema_paths(mc.ModelConfig.DESCRIPTOR)
    assert len(paths) > 150
    covered = [p for p in paths if p in IMPLEMENTED or any(p == f or p.startswith(f + ".") for f in FIELDS)]
    assert sorted(set(paths) - set(covered)) == []
    assert sorted(IMPLEMENTED - set(paths)) == [], "IMPLEMENTED names paths Triton's schema does not have"
    assert sorted(IMPLEMENTED & set(FIELDS)) == []


def test_unsupported_fields_are_found_by_path_through_repeated_fields():
    from shmserve.server.broker import unsupported

    config = parse("""name: "m" backend: "python"
        input [ { name: "A" data_type: TYPE_FP32 dims: [ 1 ] },
                { name: "B" data_type: TYPE_FP32 dims: [ 1 ] is_shape_tensor: true } ]
        optimization { cuda { graphs: true } input_pinned_memory { enable: true } }
        instance_group [ { count: 1 kind: KIND_CPU }, { count: 1 kind: KIND_CPU passive: true } ]
        response_cache { enable: true }""")
    found = {path: action for path, action, _ in unsupported.findings(config)}
    assert found == {"optimization.cuda": "warn", "optimization.input_pinned_memory": "warn",
                     "instance_group.passive": "warn", "input.is_shape_tensor": "refuse"}
    assert unsupported.refusal(config) == ("config field 'input.is_shape_tensor' is not supported: a shape tensor "
                                           "would be batched as a data tensor")
    assert "model 'm': config field 'optimization.cuda' is not supported yet and has no effect " \
           "(no CUDA graphs or CUDA options are applied)" in unsupported.warnings(config)


def test_fields_at_their_default_are_not_reported():
    from shmserve.server.broker import unsupported

    config = parse("""name: "m" backend: "python"
        input [ { name: "A" data_type: TYPE_FP32 dims: [ 1 ] allow_ragged_batch: false } ]
        instance_group [ { count: 1 kind: KIND_CPU passive: false } ]""")
    assert list(unsupported.findings(config)) == []


def test_a_backend_parameter_not_acted_on_is_warned_about_by_name():
    """Triton's Python backend runs a model in the conda-pack environment EXECUTION_ENV_PATH
    names; here it runs in the server's own, which the load says (a PyTorch model's own
    parameters of that name are nobody's, and a Python model's other parameters are its own)."""
    from shmserve.server.broker import unsupported

    text = """name: "m" backend: "python" parameters { key: "EXECUTION_ENV_PATH" value: { string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" } }
        parameters { key: "mine" value: { string_value: "x" } }"""
    assert unsupported.warnings(parse(text)) == [
        "model 'm': parameter 'EXECUTION_ENV_PATH' is not supported: the model runs in the server's own Python "
        "environment, not in the packed one: install what it imports there (docs/python_backend.md)"]
    assert unsupported.warnings(parse(text.replace('backend: "python"', 'platform: "pytorch_libtorch"')),
                                "pytorch") == []


RAGGED_IO = """name: "m" backend: "python" max_batch_size: 4
    input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
    output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def test_ragged_inputs_batch_inputs_and_batch_outputs_load(tmp_path):
    config = check(RAGGED_IO + """
        batch_input [ { kind: BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO target_name: "OFFSETS"
                        data_type: TYPE_INT32 source_input: "X" } ]
        batch_output [ { target_name: "Y" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "X" } ]""",
                   tmp_path)
    assert config.input[0].allow_ragged_batch and config.batch_input[0].target_name == ["OFFSETS"]


@pytest.mark.parametrize("extra, why", [
    ('batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "N" data_type: TYPE_FP32 source_input: "Z" } ]',
     "unknown source input name 'Z' for m"),
    ('batch_input [ { kind: BATCH_ITEM_SHAPE target_name: "N" data_type: TYPE_INT64 source_input: "X" } ]',
     "batch input data type must be TYPE_INT32 or TYPE_FP32 for m"),
    ('batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "N" data_type: TYPE_INT32 } ]',
     "batch input kind 'BATCH_ELEMENT_COUNT' expects 1 source input, got 0 for m"),
    ('batch_input [ { kind: 9 target_name: "N" data_type: TYPE_INT32 source_input: "X" } ]',
     "unknown batch input kind '9' for m"),
    ('batch_output [ { target_name: "Q" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "X" } ]',
     "unknown target output name 'Q' for m"),
    ('batch_output [ { target_name: "Y" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "Z" } ]',
     "unknown source input name 'Z' for m"),
    ('batch_output [ { target_name: [ "Y", "Y" ] kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "X" } ]',
     "target output name 'Y' can only be specified once for m"),
    ('batch_output [ { target_name: "Y" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: [ "X", "X" ] } ]',
     "batch output kind 'BATCH_SCATTER_WITH_INPUT_SHAPE' expects 1 source input, got 2 for m"),
])
def test_batch_inputs_and_outputs_are_refused_with_tritons_text(tmp_path, extra, why):
    with pytest.raises(ConfigError) as e:
        check(RAGGED_IO + extra, tmp_path)
    assert str(e.value) == why


def test_the_onnx_backends_own_optimization_fields_are_not_findings():
    """``optimization.graph`` and ``execution_accelerators`` are applied by the onnxruntime
    backend; for any other backend they stay warnings."""
    from shmserve.server.broker import unsupported

    fields = """optimization { graph { level: 1 } priority: PRIORITY_MAX
        execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" } ] } }"""
    onnx = parse(f'name: "m" platform: "onnxruntime_onnx" backend: "onnxruntime" {fields}')
    assert [path for path, _, _ in unsupported.findings(onnx)] == ["optimization.priority"]
    python = parse(f'name: "m" backend: "python" {fields}')
    assert {path for path, _, _ in unsupported.findings(python)} == {
        "optimization.graph", "optimization.priority", "optimization.execution_accelerators"}


def test_a_dynamic_batcher_waits_for_the_backend_to_complete_max_batch_size(tmp_path):
    """Without --strict-model-config the backend may set max_batch_size (an ONNX graph that
    batches), so the batcher is not refused before the completed config is validated."""
    d = model_dir(tmp_path, config='name: "m" platform: "onnxruntime_onnx" dynamic_batching { preferred_batch_size: 4 }',
                  files={"1/model.onnx": ""})
    config = cfgmod.load_config(d, strict=False)
    cfgmod.validate(config, d, BACKENDS | {"onnxruntime"}, [1], completed_later=True)
    with pytest.raises(ConfigError, match="model 'm': dynamic_batching.preferred_batch_size 4 must be between 1 and"):
        cfgmod.validate(config, d, BACKENDS | {"onnxruntime"}, [1])
