"""The shape of the code: the product's imports run one way (no module reaches, even lazily, a module that reaches
it back), so each layer can be read and changed on its own; and the product imports nothing from the benchmark
package beside it (kvmem_bench, `bench/`). The layers are in docs/ARCHITECTURE.md."""

from __future__ import annotations

import copy
from graphlib import CycleError, TopologicalSorter

import grimp
import pytest

BENCHMARK = "kvmem_bench"


@pytest.fixture(scope="module")
def graph():
    # every import counts, also those inside functions; `if TYPE_CHECKING:` ones run never and do not. Other
    # packages appear as one module each (kvmem_bench among them, if anything imported it).
    return grimp.build_graph("kvmem", exclude_type_checking_imports=True, include_external_packages=True)


def product_modules(graph) -> set[str]:
    return {m for m in graph.modules if m == "kvmem" or m.startswith("kvmem.")}


def test_the_product_imports_nothing_from_the_benchmark(graph):
    importers = {m for m in product_modules(graph) if BENCHMARK in graph.find_modules_directly_imported_by(m)}
    assert not importers, f"{sorted(importers)} import {BENCHMARK}"
    import kvmem_bench  # and the benchmark package is installed beside it (make setup), found by the CLI

    assert kvmem_bench.__file__


def test_the_benchmark_check_finds_an_import(graph):
    graph = copy.deepcopy(graph)
    graph.add_import(importer="kvmem.generate", imported=BENCHMARK, line_number=1, line_contents="import kvmem_bench")
    assert BENCHMARK in graph.find_modules_directly_imported_by("kvmem.generate")


def import_order(graph, modules: set[str]) -> TopologicalSorter:
    """The modules ordered by their imports among themselves; `prepare()` raises CycleError on a circle."""
    return TopologicalSorter({m: graph.find_modules_directly_imported_by(m) & modules for m in modules})


def assert_no_circle(graph, modules: set[str]) -> None:
    try:
        import_order(graph, modules).prepare()
    except CycleError as e:
        pytest.fail("import circle: " + " -> ".join(e.args[1]))


def test_the_product_has_no_import_circle(graph):
    assert_no_circle(graph, product_modules(graph))


def test_the_circle_check_finds_a_circle(graph):
    """The check above, on the same graph with one upward import added (storage importing the server): it fails."""
    graph = copy.deepcopy(graph)
    graph.add_import(importer="kvmem.rows", imported="kvmem.serve.scheduler", line_number=1, line_contents="import")
    product = product_modules(graph)
    with pytest.raises(CycleError):
        import_order(graph, product).prepare()


# (lower, upper): the lower never reaches the upper, directly or through others. `pkg.*` stands for every module of
# a package; `kvmem.quant` alone is its __init__, the scheme registry (`get_scheme`), and kvmem.quant.base the
# quantized rows the cache holds.
LAYERS = [("kvmem.rows", "kvmem.layer"), ("kvmem.layer", "kvmem.cache"), ("kvmem.quant.base", "kvmem.cache"), ("kvmem.cache", "kvmem.quant"),
          ("kvmem.cache", "kvmem.compress.*"), ("kvmem.cache", "kvmem.models"), ("kvmem.models", "kvmem.forward"),
          ("kvmem.compress.*", "kvmem.generate"), ("kvmem.quant.*", "kvmem.generate"), ("kvmem.quant.*", "kvmem.store.*"),
          ("kvmem.reuse.prefix", "kvmem.generate"), ("kvmem.store.*", "kvmem.generate"), ("kvmem.generate", "kvmem.serve.*")]


def _chain(graph, low: str, high: str):
    """The shortest import chain from `low` (or a module of it) to `high` (or a module of it), or None."""
    lows = graph.find_descendants(low[:-2]) | {low[:-2]} if low.endswith(".*") else {low}
    highs = graph.find_descendants(high[:-2]) | {high[:-2]} if high.endswith(".*") else {high}
    chains = [graph.find_shortest_chain(importer=a, imported=b) for a in sorted(lows) for b in sorted(highs)]
    return min((c for c in chains if c), key=len, default=None)


@pytest.mark.parametrize("low, high", LAYERS)
def test_a_lower_layer_reaches_no_upper_one(graph, low, high):
    chain = _chain(graph, low, high)
    assert chain is None, f"{low} reaches {high}: {' -> '.join(chain)}"


def test_the_layer_check_finds_an_upward_import(graph):
    graph = copy.deepcopy(graph)
    graph.add_import(importer="kvmem.quant.pack", imported="kvmem.store.store", line_number=1, line_contents="import")
    assert _chain(graph, "kvmem.quant.*", "kvmem.store.*") == ("kvmem.quant.pack", "kvmem.store.store")


# -- the benchmark package: one folder per benchmark (runner -> report), one README helper on top ---------------------
@pytest.fixture(scope="module")
def bench_graph():
    return grimp.build_graph(BENCHMARK, exclude_type_checking_imports=True)


def test_the_benchmark_has_no_import_circle(bench_graph):
    assert_no_circle(bench_graph, bench_graph.modules)


def test_reports_read_results_and_never_run_a_benchmark(bench_graph):
    """A report is rebuilt from records alone (`python -m kvmem_bench.readme` on any checkout), so no report module
    reaches a runner; and only the CLI and the tests reach the README helper's list of reports."""
    reports = sorted(m for m in bench_graph.modules if m.endswith(".report"))
    runners = sorted(m for m in bench_graph.modules if m.endswith(".runner"))
    assert len(reports) >= 6 and len(runners) >= 8
    chains = [bench_graph.find_shortest_chain(importer=a, imported=b) for a in reports for b in runners]
    assert not any(chains), [" -> ".join(c) for c in chains if c]
    assert not bench_graph.find_modules_that_directly_import(f"{BENCHMARK}.readme")


def test_the_benchmark_checks_find_a_circle_and_a_report_running_a_benchmark(bench_graph):
    graph = copy.deepcopy(bench_graph)
    graph.add_import(importer=f"{BENCHMARK}.longctx.scores", imported=f"{BENCHMARK}.longctx.runner", line_number=1,
                     line_contents="import")  # the runner writes its report, which reads the scores: a circle now
    modules = graph.modules
    with pytest.raises(CycleError):
        import_order(graph, modules).prepare()
    assert graph.find_shortest_chain(importer=f"{BENCHMARK}.longctx.report", imported=f"{BENCHMARK}.longctx.runner")
