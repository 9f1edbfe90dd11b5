"""bench/router_bench.py at toy sizes: every part runs against real processes and prints its figures
(part 3 without vLLM: pdserve's rows at two stream intervals)."""
from __future__ import annotations

import re

import pytest

from bench import router_bench

pytestmark = pytest.mark.e2e


def test_every_part_prints_its_figures(capsys):
    assert router_bench.main(["--requests", "5", "--seconds", "0.5", "--no-vllm", "--stream-intervals", "1,4",
                              "--streams", "4", "--stream-tokens", "16"]) == 0
    out = capsys.readouterr().out
    figures = dict(re.findall(r"^(\w+)=([-\d.]+)$", out, re.M))
    assert set(figures) == {"router_added_p50_ms", "router_added_p99_ms", "router_max_rps_one_core",
                            "serving_path_us_per_streamed_token", "stream_interval_4_path_cpu_ratio"}
    assert float(figures["router_max_rps_one_core"]) > 0
    assert float(figures["serving_path_us_per_streamed_token"]) > 0
    rows = re.findall(r"^pdserve\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+router ([\d.]+), service host ([\d.]+)$",
                      out, re.M)
    assert [int(r[0]) for r in rows] == [1, 4]
    for _, tokens_per_s, front, _, router, host in rows:
        assert int(tokens_per_s) > 0 and float(front) == pytest.approx(float(router) + float(host), abs=0.11)


def test_parts_are_checked():
    with pytest.raises(SystemExit):
        router_bench.main(["--parts", "4"])


def test_part_three_not_streamed_prints_the_router_intervals_figures(capsys):
    assert router_bench.main(["--parts", "3", "--seconds", "0.5", "--no-vllm", "--non-streaming",
                              "--stream-intervals", "1,64", "--streams", "4", "--stream-tokens", "32"]) == 0
    out = capsys.readouterr().out
    figures = dict(re.findall(r"^(\w+)=([-\d.]+)$", out, re.M))
    assert set(figures) == {"non_streaming_path_us_per_token", "non_streaming_interval_64_path_cpu_ratio"}
    assert float(figures["non_streaming_path_us_per_token"]) > 0
    assert float(figures["non_streaming_interval_64_path_cpu_ratio"]) > 0
