"""bench/cpu_attention_bench.py on small shapes: both paths run on the same blocks, agree, and the figures print."""
import re

import pytest

from bench import cpu_attention_bench


def test_block_tables_as_the_allocator_hands_them_out():
    # 2 sequences x 12 blocks: 8 prompt blocks each together, then one block a sequence in turn.
    t = cpu_attention_bench.block_tables(2, 12 * 16, in_turn=True)
    assert t[0].tolist() == list(range(1, 9)) + [17, 19, 21, 23]
    assert t[1].tolist() == list(range(9, 17)) + [18, 20, 22, 24]
    assert cpu_attention_bench.block_tables(2, 12 * 16, in_turn=False)[1].tolist() == list(range(13, 25))


def test_bench_compares_the_kernel_with_the_torch_path(capsys):
    # No skip without the extension: it must build here (tests/test_cpu_attention.py says so too),
    # and the benchmark exits 1 without it, which fails this test loudly.
    assert cpu_attention_bench.main(["--shapes", "3x200", "--blocks", "64", "--reps", "1", "--threads", "1",
                                     "--prefill", "96,32@48+20", "--prefill-heads", "8/4/64"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("3 x 200")]
    assert [row[16:28].strip() for row in rows] == ["in turn", "contiguous", "in cache"]
    speedup = re.search(r"cpu_decode_attention_vs_torch_speedup=([0-9.]+)", out)
    assert speedup and float(speedup.group(1)) > 0
    prefill = re.search(r"cpu_prefill_attention_vs_sdpa_speedup=([0-9.]+)", out)
    assert prefill and float(prefill.group(1)) > 0


def test_bench_refuses_a_cache_too_small_for_the_shape():
    with pytest.raises(SystemExit, match="cannot hold"):
        cpu_attention_bench.main(["--shapes", "8x1024", "--blocks", "64"])
