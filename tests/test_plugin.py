"""The pytest plugin: readable ids, one test written once for both tiers, GPU-only tests kept off the CPU
tier, and reasons for what cannot run here."""

from __future__ import annotations

from typing import Any

import pytest

pytest_plugins = ["pytester"]

TESTS = """
import pytest

def test_parity(strategy, world_size):
    pass

@pytest.mark.gpu
@pytest.mark.strategies("ddp", "zero3")
def test_gpu_only(strategy, world_size):
    pass
"""


@pytest.fixture
def collect(pytester: pytest.Pytester):
    pytester.makepyfile(test_ids=TESTS)

    def run(*args: str) -> list[str]:
        result = pytester.runpytest("-p", "distbench.testsuite.plugin", "--collect-only", "-q", *args)
        return [ln for ln in result.outlines if "::" in ln]

    return run


def test_ids_name_strategy_world_size_and_tier(collect):
    ids = collect("--strategies", "zero3,single", "--world-sizes", "1,2")
    assert "test_ids.py::test_parity[zero3-ws2]" in ids
    assert "test_ids.py::test_parity[zero3-ws2-gpu]" in ids
    assert "test_ids.py::test_parity[single-ws1]" in ids
    assert not any("single-ws2" in i for i in ids), "single runs on one rank only"


def test_gpu_marked_tests_have_no_cpu_tier_cases(collect):
    ids = [i for i in collect("-m", "gpu", "--world-sizes", "1,2") if "test_gpu_only" in i]
    assert ids == [f"test_ids.py::test_gpu_only[{s}-ws{n}-gpu]" for n in (1, 2) for s in ("ddp", "zero3")]


def test_plain_pytest_deselects_the_gpu_tier(collect):
    ids = collect("-m", "not gpu", "--strategies", "ddp", "--world-sizes", "2")
    assert ids == ["test_ids.py::test_parity[ddp-ws2]"]


def test_what_cannot_run_here_skips_with_the_reason(pytester):
    pytester.makepyfile(test_ids=TESTS)
    result = pytester.runpytest(
        "-p",
        "distbench.testsuite.plugin",
        "-rs",
        "-m",
        "not gpu",
        "--strategies",
        "fsdp1_full,ddp",
        "--world-sizes",
        "1",
    )
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*fsdp1_full needs CUDA GPUs (legacy FSDP1 requires CUDA)*"])


def test_the_header_names_a_known_breakage_and_its_fix(pytester, monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    pytester.makepyfile(test_ids=TESTS)
    result = pytester.runpytest(
        "-p",
        "distbench.testsuite.plugin",
        "--collect-only",
        "-m",
        "not gpu",
        "--strategies",
        "ddp",
        "--world-sizes",
        "1",
    )
    result.stdout.fnmatch_lines(
        ["distbench: FAIL TORCH_CUDA_ARCH_LIST: '9.0a'*; fix: export TORCH_CUDA_ARCH_LIST=9.0"]
    )


def test_lanes_plan_for_a_typical_cases_peak_not_the_largest():
    """Seats come from the mean of the measured peaks per rank: a tenth of the cases holding 20 GiB must not
    cut a 141 GiB GPU's lanes to 5 when the rest hold 3 GiB (the lanes hold back work while a GPU is nearly
    full, and rerun alone a case that ran out of memory)."""
    from distbench.testsuite.plugin import _rank_peak_estimate
    from distbench.testsuite.schedule import Case

    gib = 2**30
    cases = [Case(f"t{i}", 1, "g") for i in range(20)]
    peaks = {f"t{i}": 3.0 * gib for i in range(18)} | {"t18": 20.0 * gib, "t19": 20.0 * gib}
    assert _rank_peak_estimate(None, cases, peaks) == pytest.approx(4.7 * gib)  # type: ignore[arg-type]
    peaks |= {f"t{i}": 12.0 * gib for i in range(10, 18)}  # half of them large: they count
    assert _rank_peak_estimate(None, cases, peaks) >= 8.0 * gib  # type: ignore[arg-type]
    # cases shorter than a sampling period have no peak: the rest still stand for them (not the largest)
    del peaks["t0"], peaks["t1"]
    assert _rank_peak_estimate(None, cases, peaks) < 10.0 * gib  # type: ignore[arg-type]


def test_a_test_whose_jobs_leave_device_memory_is_named_in_the_summary(pytester):
    """A rank pool serves a session: memory a test's jobs leave allocated stays beside every later test of the
    pool (on an H200, 2-8 GiB per lane). The test that left it is named, with the bytes."""
    pytester.makepyfile(
        test_leaks="""
        from distbench.testsuite.suite import Suite

        def test_leaks(monkeypatch, suite):  # monkeypatch first: still in place when suite's teardown reads
            monkeypatch.setattr(Suite, "held_bytes", lambda self: 3 * 2**30)

        def test_tidy(suite):
            pass
    """
    )
    result = pytester.runpytest_inprocess("-p", "distbench.testsuite.plugin")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "*device memory left allocated in a rank pool after 1 test(s)*3.00 GiB after test_leaks.py::test_leaks"
        ]
    )


def test_committed_durations_order_a_fresh_runner_and_a_damaged_file_is_named(tmp_path):
    """A fresh runner's pytest cache is empty: the lanes plan from the tier's committed seconds
    (distbench_durations); a file that is not a table of seconds stops the session, named."""
    import json
    from types import SimpleNamespace

    import distbench.testsuite.plugin as plugin

    def config(name: str) -> Any:
        return SimpleNamespace(getini=lambda key: name, rootpath=tmp_path)

    (tmp_path / "d.json").write_text(json.dumps({"tests/t.py::a[zero3-ws1-gpu]": 19.5, "tests/t.py::b": 2}))
    assert plugin._committed_durations(config("d.json")) == {
        "tests/t.py::a[zero3-ws1-gpu]": 19.5,
        "tests/t.py::b": 2.0,
    }
    assert plugin._committed_durations(config("")) == {}
    (tmp_path / "bad.json").write_text('{"tests/t.py::a": "slow"}')
    for name in ("bad.json", "missing.json"):
        with pytest.raises(pytest.UsageError, match=name):
            plugin._committed_durations(config(name))


def test_the_committed_gpu_durations_name_tests_that_exist(pytestconfig):
    """The file is regenerated from a tier run (scripts/tier_durations.py): a renamed test would plan blind."""
    import distbench.testsuite.plugin as plugin

    table = plugin._committed_durations(pytestconfig)
    assert len(table) > 100
    missing = [t for t in table if not (pytestconfig.rootpath / t.split("::")[0]).exists()]
    assert not missing, missing


def test_a_test_up_to_a_world_size_skips_the_larger_defaults_and_runs_them_when_named(pytester):
    """up_to_world_size: the tier's larger default world sizes skip with the reason and the option that runs
    them; a --world-sizes that names them runs them."""
    pytester.makepyfile(
        test_upto="""
        import pytest

        @pytest.mark.up_to_world_size(1)
        def test_recipe(strategy, world_size):
            pass
        """
    )
    args = ("-p", "distbench.testsuite.plugin", "-rs", "-m", "not gpu", "--strategies", "ddp")
    default = pytester.runpytest(*args)
    default.assert_outcomes(passed=1, skipped=1)
    default.stdout.fnmatch_lines(["*does not change past 1 ranks*`--world-sizes 2` runs it here*"])
    pytester.runpytest(*args, "--world-sizes", "1,2").assert_outcomes(passed=2)


def test_what_the_machine_cannot_run_is_the_reason_given_before_up_to_world_size(pytester):
    """A world-size-2 case this machine cannot run (no GPU) names that, not the option that would run it."""
    pytester.makepyfile(
        test_upto="""
        import pytest

        @pytest.mark.up_to_world_size(1)
        def test_recipe(strategy, world_size):
            pass
        """
    )
    result = pytester.runpytest("-p", "distbench.testsuite.plugin", "-rs", "-m", "gpu", "--strategies", "ddp")
    result.assert_outcomes(skipped=3)  # world sizes 1, 2 and 4, the GPU tier's defaults
    result.stdout.fnmatch_lines(["*SKIPPED [[]3[]]*gpu tier: no CUDA device on this machine*"])
    result.stdout.no_fnmatch_line("*runs it here*")


DEFAULT_CASES = """
import pytest

@pytest.mark.strategies("ddp", "fsdp_full")
@pytest.mark.default_cases("ddp-ws2", "fsdp_full-ws2")
def test_kept(strategy, world_size):
    pass
"""


def test_default_cases_leave_the_other_cpu_cases_to_the_nightly_selection(pytester):
    pytester.makepyfile(test_ids=DEFAULT_CASES)

    def ids(*args: str) -> list[str]:
        result = pytester.runpytest("-p", "distbench.testsuite.plugin", "--collect-only", "-q", *args)
        return sorted(ln.split("[")[1].rstrip("]") for ln in result.outlines if "::" in ln)

    assert ids("-m", "not gpu and not nightly") == ["ddp-ws2", "fsdp_full-ws2"]
    assert ids("-m", "nightly") == ["ddp-ws1", "fsdp_full-ws1"]
    assert ids("-m", "gpu") == [
        "ddp-ws1-gpu",
        "ddp-ws2-gpu",
        "ddp-ws4-gpu",
        "fsdp_full-ws1-gpu",
        "fsdp_full-ws2-gpu",
        "fsdp_full-ws4-gpu",
    ]  # the GPU tier's cases are its own
    # cases named on the command line run whatever the mark
    assert ids("-m", "not gpu and not nightly", "--strategies", "ddp") == ["ddp-ws1", "ddp-ws2"]


def test_default_cases_naming_no_case_of_the_test_stops_collection(pytester):
    pytester.makepyfile(test_ids=DEFAULT_CASES.replace('"fsdp_full-ws2"', '"fsdp_ful-ws2"'))
    result = pytester.runpytest("-p", "distbench.testsuite.plugin", "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.INTERRUPTED  # a collection error
    assert "test_ids.py::test_kept: default_cases names no case ['fsdp_ful-ws2']" in result.stdout.str()
