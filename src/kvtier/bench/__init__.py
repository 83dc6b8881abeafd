"""``kvtier bench``: the same seeded workload against vLLM alone, vLLM's ExampleConnector and
kvtier, each on its own fresh ``vllm serve``, compared on TTFT, latency, throughput, prompt tokens
by cache source, kvtier's transfers, and identical greedy outputs.

Modules, one job each: :mod:`~kvtier.bench.workloads` (request lists), :mod:`~kvtier.bench.client`
(one streamed request), :mod:`~kvtier.bench.driver` (a workload against a server),
:mod:`~kvtier.bench.servers` (start/stop a mode's server), :mod:`~kvtier.bench.metrics`
(``/metrics`` scrape and diff), :mod:`~kvtier.bench.stats` (percentiles, output comparison, goals),
:mod:`~kvtier.bench.runner` (modes in turn), :mod:`~kvtier.bench.report` / :mod:`~kvtier.bench.plot`
(JSON, table, figure), :mod:`~kvtier.bench.command` (the command's body), :mod:`~kvtier.cli.bench`
(its flags). Nothing here imports vLLM: servers are subprocesses, talked to over HTTP.
"""
