"""The SGLang backend's command lines, environment and config checks (generation/sglang_backend.py)."""

import sys

import pytest

from areal_flow.config.schema import GenerationConfig, RunConfig
from areal_flow.config.validate import check_ranges
from areal_flow.generation.sglang_backend import generation_problems, sglang_command, sglang_env, sglang_missing
from areal_flow.runtime.spec import RunSpec, reachable

SGLANG = [sys.executable, "-m", "sglang.launch_server"]


def sglang(**kw) -> GenerationConfig:
    return GenerationConfig(backend="sglang", **kw)


def test_default_command_maps_the_run_and_leaves_sglang_its_own_defaults():
    argv = sglang_command(sglang(), "/models/base", 31000, 7, "cpu")
    assert argv == [*SGLANG, "--model-path", "/models/base", "--host", "127.0.0.1", "--port", "31000",
                    "--tp-size", "1", "--random-seed", "7", "--device", "cpu", "--skip-tokenizer-init"]


def test_servers_that_answer_an_agent_s_chat_calls_load_the_tokenizer():
    assert "--skip-tokenizer-init" not in sglang_command(sglang(), "/m", 1, 0, "cpu", tokenizer=True)


def test_every_mapped_key_becomes_its_sglang_flag_and_extra_args_come_last_verbatim():
    gen = sglang(host="0.0.0.0", tp_size=2, max_batch_size=256, max_total_tokens=65536, mem_fraction_static=0.85,
                 context_length=4096,
                 dtype="bfloat16", attention_backend="fa3", chunked_prefill_size=-1, disable_radix_cache=True,
                 extra_args=["--log-level", "warning", "--trust-remote-code"])
    argv = sglang_command(gen, "/m", 30001, 3, "cuda")
    pairs = dict(zip(argv[3::1], argv[4::1]))
    assert pairs["--host"] == "0.0.0.0" and pairs["--tp-size"] == "2" and pairs["--device"] == "cuda"
    assert pairs["--max-running-requests"] == "256" and pairs["--mem-fraction-static"] == "0.85"
    assert pairs["--max-total-tokens"] == "65536"
    assert pairs["--context-length"] == "4096" and pairs["--dtype"] == "bfloat16"
    assert pairs["--attention-backend"] == "fa3" and pairs["--chunked-prefill-size"] == "-1"
    assert "--disable-radix-cache" in argv and "--skip-tokenizer-init" in argv
    assert argv[-3:] == ["--log-level", "warning", "--trust-remote-code"]


def test_unset_keys_pass_no_flag():
    argv = sglang_command(sglang(disable_radix_cache=False), "/m", 1, 0, "cpu")
    for flag in ("--max-running-requests", "--max-total-tokens", "--mem-fraction-static", "--context-length", "--dtype",
                 "--attention-backend", "--chunked-prefill-size", "--disable-radix-cache"):
        assert flag not in argv


def test_cpu_servers_bind_each_tp_rank_to_its_share_of_the_servers_cores():
    assert sglang_env((2, 3, 4, 5), 2, "cpu", pin_cpus=True) == {
        "SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CPU_OMP_THREADS_BIND": "2,3|4,5"}
    assert sglang_env((0,), 1, "cpu", pin_cpus=True)["SGLANG_CPU_OMP_THREADS_BIND"] == "0"
    # Unpinned, SGLang binds by NUMA node itself; on CUDA the launcher's CUDA_VISIBLE_DEVICES suffices.
    assert sglang_env((0, 1), 2, "cpu", pin_cpus=False) == {"SGLANG_USE_CPU_ENGINE": "1"}
    assert sglang_env((0, 1), 2, "cuda", pin_cpus=True) == {}


@pytest.mark.parametrize("tp_size,n,ok", [(1, 3, True), (2, 4, True), (4, 4, True), (2, 3, False), (3, 4, False)])
def test_tp_size_must_divide_the_generate_mesh(tp_size, n, ok):
    problems = generation_problems(sglang(tp_size=tp_size), n)
    assert (problems == []) == ok
    if not ok:
        assert problems == [f"generation.tp_size={tp_size} does not divide the {n} device(s) of the generate mesh "
                            "(one server per tp_size devices)"]


@pytest.mark.parametrize("arg,key", [
    ("--tp-size", "generation.tp_size"),
    ("--tp_size=2", "generation.tp_size"),
    ("--tensor-parallel-size", "generation.tp_size"),
    ("--tp", "generation.tp_size"),  # argparse takes an unambiguous prefix
    ("--mem-fraction-static=0.5", "generation.mem_fraction_static"),
    ("--max-running-requests", "generation.max_batch_size"),
    ("--disable-radix-cache", "generation.disable_radix_cache"),
    ("--model", "model.path"),
    ("--random-seed", "seed"),
    ("--device", "cluster.device_type"),
    ("--port", "the launcher"),
    ("--skip-tokenizer-init", "areal_flow"),
])
def test_extra_args_that_duplicate_a_mapped_flag_name_the_key_that_sets_it(arg, key):
    problems = generation_problems(sglang(extra_args=["--log-level", "warning", arg, "1"]), 1)
    assert len(problems) == 1
    assert problems[0].startswith(f"generation.extra_args has {arg!r}, which would set --") and key in problems[0]


def test_extra_args_of_unmapped_flags_are_accepted():
    gen = sglang(extra_args=["--log-level", "warning", "--trust-remote-code", "--cuda-graph-max-bs-decode=64",
                             "--model-impl", "transformers"])
    assert generation_problems(gen, 1) == []


@pytest.mark.parametrize("key,value", [("attention_backend", "fa3"), ("context_length", 4096), ("extra_args", ["--log-level", "debug"])])
def test_sglang_settings_need_the_sglang_backend(key, value):
    problems = generation_problems(GenerationConfig(**{key: value}), 1)
    assert problems == [f"generation.{key}={value!r} is an SGLang setting; it needs generation.backend=sglang "
                        "(the backend is 'embedded')"]


def test_embedded_backend_takes_tp_size_batch_and_memory_settings_and_dtype():
    gen = GenerationConfig(tp_size=2, max_batch_size=16, max_total_tokens=4096, host="0.0.0.0",
                           mem_fraction_static=0.5, dtype="bfloat16", chunked_prefill_size=512, page_size=8,
                           disable_cuda_graph=True, disable_radix_cache=True)
    assert generation_problems(gen, 2) == []


def test_the_embedded_server_gets_the_paged_cache_settings(model_dirs):
    """generation.chunked_prefill_size, page_size, disable_cuda_graph, disable_radix_cache and
    disable_overlap_schedule reach the embedded server's command line; the server reports them in
    /server_info."""
    from generation_helpers import http_call, running_server

    from areal_flow.graph.placement import Proc
    from areal_flow.launchers.commands import server_command

    cfg = RunConfig(generation=GenerationConfig(chunked_prefill_size=64, page_size=8, disable_cuda_graph=True,
                                                disable_radix_cache=True, disable_overlap_schedule=True))
    argv, _ = server_command(cfg, Proc("gen0", "gen_server", (0,)), model_dirs.a, 0)
    assert argv[argv.index("--chunked-prefill-size") + 1] == "64" and argv[argv.index("--page-size") + 1] == "8"
    assert "--disable-cuda-graph" in argv and "--disable-radix-cache" in argv and "--disable-overlap-schedule" in argv
    default = server_command(RunConfig(), Proc("gen0", "gen_server", (0,)), model_dirs.a, 0)[0]
    assert "--disable-radix-cache" not in default and "--disable-overlap-schedule" not in default
    with running_server(model_dirs.a, page_size=8, chunked_prefill_size=64, cuda_graphs=False,
                        prefix_cache=False, overlap=False) as server:
        _, _, info = http_call(server.url, "GET", "/server_info")
    assert (info["page_size"], info["chunked_prefill_size"], info["disable_cuda_graph"],
            info["disable_radix_cache"], info["disable_overlap_schedule"]) == (8, 64, True, True, True)


@pytest.mark.parametrize("field,value,message", [
    ("backend", "vllm", "generation.backend='vllm' must be one of embedded, sglang"),
    ("tp_size", 0, "generation.tp_size=0 must be ≥ 1"),
    ("mem_fraction_static", 1.5, "generation.mem_fraction_static=1.5 must be ≤ 1"),
    ("dtype", "fp8", "generation.dtype='fp8' must be one of auto, half, float16, bfloat16, float, float32"),
])
def test_bad_values_name_the_key(field, value, message):
    cfg = RunConfig(generation=GenerationConfig(**{field: value}))
    assert message in check_ranges(cfg)


def test_a_missing_sglang_names_the_install_command():
    if not sglang_missing():
        pytest.skip("sglang is importable here")
    assert "pip install -e '.[sglang]'" in sglang_missing() and sys.executable in sglang_missing()


@pytest.mark.parametrize("host,url", [("127.0.0.1", "http://127.0.0.1:9"), ("0.0.0.0", "http://127.0.0.1:9"),
                                      ("10.0.0.5", "http://10.0.0.5:9"), ("::", "http://[::1]:9")])
def test_clients_reach_the_servers_at_generation_host(host, url):
    spec = RunSpec(run_dir="/r", model_path="/m", train_path="/t", eval_path="/e", gen_ports=[9], controller_port=1,
                   rollout_ports=[], trainer_ports=[], dist_port=2, n_trainers=1, n_rollout=1, gen_host=reachable(host))
    assert spec.gen_urls == [url]


def test_the_embedded_server_command_maps_the_budget_keys_and_labels_version_0():
    from areal_flow.graph.placement import Proc
    from areal_flow.launchers.commands import server_command

    cfg = RunConfig(seed=5, generation=GenerationConfig(max_batch_size=16, max_total_tokens=4096))
    argv, env = server_command(cfg, Proc("gen_server1", "gen_server", (2, 3), rank=1), "/m", 31000)
    pairs = dict(zip(argv[3:], argv[4:]))
    assert argv[:3] == [sys.executable, "-m", "areal_flow.generation.server"] and env == {}
    assert pairs["--max-batch-size"] == "16" and pairs["--max-total-tokens"] == "4096"
    assert pairs["--num-threads"] == "2" and pairs["--seed"] == "6" and pairs["--weight-version"] == "0"
    assert pairs["--device"] == "cpu" and pairs["--dtype"] == "auto"
    bare, _ = server_command(RunConfig(), Proc("gen_server0", "gen_server", (0,)), "/m", 31000)
    assert "--max-total-tokens" not in bare and "--max-batch-size" not in bare


def test_the_embedded_server_command_on_cuda_takes_the_device_dtype_and_memory_share():
    from areal_flow.config.schema import ClusterConfig
    from areal_flow.graph.placement import Proc
    from areal_flow.launchers.commands import server_command

    cfg = RunConfig(cluster=ClusterConfig(device_type="cuda"),
                    generation=GenerationConfig(dtype="bfloat16", mem_fraction_static=0.4))
    argv, _ = server_command(cfg, Proc("gen_server0", "gen_server", (3,), local_devices=(3,)), "/m", 31000)
    pairs = dict(zip(argv[3:], argv[4:]))
    assert pairs["--device"] == "cuda" and pairs["--dtype"] == "bfloat16" and pairs["--mem-fraction-static"] == "0.4"
    assert "--num-threads" not in argv  # its threads feed the GPU; the launcher gives it GPU 3 alone


def test_a_secured_run_gives_each_server_the_hosts_address_and_its_key_off_the_embedded_command_line():
    from areal_flow.config.schema import LauncherConfig
    from areal_flow.graph.placement import Proc
    from areal_flow.launchers.commands import server_command, server_host
    from areal_flow.runtime.security import API_KEY_ENV, security_needed

    proc = Proc("gen_server0", "gen_server", (0,))
    secured = RunConfig(launcher=LauncherConfig(secure=True))
    assert not security_needed(RunConfig()) and security_needed(secured)
    # Off: generation.host as configured; on: the host's address instead of loopback, but an
    # address the config names (a wildcard, another interface) stays.
    assert server_host(RunConfig(), "10.1.2.3") == "127.0.0.1"
    assert server_host(secured, "10.1.2.3") == "10.1.2.3"
    wildcard = RunConfig(launcher=LauncherConfig(secure=True), generation=GenerationConfig(host="0.0.0.0"))
    assert server_host(wildcard, "10.1.2.3") == "0.0.0.0"

    argv, env = server_command(secured, proc, "/m", 31000, host="10.1.2.3", api_key="k3y")
    assert dict(zip(argv[3:], argv[4:]))["--host"] == "10.1.2.3"
    assert "k3y" not in argv and env == {API_KEY_ENV: "k3y"}  # other users can read a command line
    sglang_cfg = RunConfig(launcher=LauncherConfig(secure=True), generation=sglang())
    argv, _ = server_command(sglang_cfg, proc, "/m", 31000, host="10.1.2.3", api_key="k3y")
    pairs = dict(zip(argv[3:], argv[4:]))
    assert pairs["--api-key"] == "k3y" and pairs["--host"] == "10.1.2.3"
    assert "--api-key" not in sglang_command(sglang(), "/m", 1, 0, "cpu")


def test_extra_args_may_not_set_the_api_key():
    problems = generation_problems(sglang(extra_args=["--api-key", "mine"]), 1)
    assert len(problems) == 1 and "decided by the launcher" in problems[0] and "set that key" not in problems[0]
