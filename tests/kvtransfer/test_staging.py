"""KV staging through host buffers, chunk by chunk with two buffers in turn: bit-exact on the CPU
here; on a GPU (make gpu-check) a CPU engine pulls from a GPU one and the other way round."""
from __future__ import annotations

import pytest
import torch

from kernels import get_backend
from kvtransfer import KVLayout, create_connector
from kvtransfer.staging import HostStaging, layer_chunks

from kv_peers import SECRET, blocks_bytes, fill, wait_events

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check)")
LAYOUT = dict(num_layers=5, num_kv_heads=2, head_dim=16, block_size=8, dtype="bfloat16")
SRC_IDS = [5, 9, 2, 40, 41, 42, 63, 0]
DST_IDS = [60, 0, 1, 2, 30, 31, 7, 8]


def caches(layout: KVLayout, n: int, device: str, seed: int | None) -> list[torch.Tensor]:
    made = [torch.zeros(layout.cache_shape(n), dtype=layout.torch_dtype) for _ in range(layout.num_layers)]
    if seed is not None:
        fill(made, seed)  # random bit patterns, NaNs included
    return [c.to(device) for c in made]


@pytest.mark.parametrize("chunk_bytes", [1, 3000, 1 << 20])
def test_host_staging_round_trip_is_bit_exact(chunk_bytes):
    """One layer per chunk, a few per chunk, or all in one: the chunks that reach the wire, put
    back by the receiver's staging, land bit for bit in other block ids."""
    layout = KVLayout(**LAYOUT)
    kernels = get_backend("torch", "cpu")
    src, dst = caches(layout, 64, "cpu", seed=3), caches(layout, 64, "cpu", seed=None)
    wire: list[torch.Tensor] = []
    HostStaging(layout, "cpu", chunk_bytes).send_host(kernels, src, SRC_IDS, lambda host: wire.append(host.clone()))
    assert len(wire) == len(list(layer_chunks(layout, len(SRC_IDS), chunk_bytes)))
    chunks = iter(wire)
    HostStaging(layout, "cpu", chunk_bytes).recv_host(kernels, dst, DST_IDS, lambda host: host.copy_(next(chunks)))
    assert blocks_bytes(dst, DST_IDS) == blocks_bytes(src, SRC_IDS)
    untouched = [b for b in range(64) if b not in DST_IDS]
    assert blocks_bytes(dst, untouched) == blocks_bytes(caches(layout, 64, "cpu", None), untouched)


def test_a_failed_send_stops_the_transfer():
    layout = KVLayout(**LAYOUT)
    sent = []

    def send(host):
        if sent:
            raise ConnectionError("peer gone")
        sent.append(host)

    with pytest.raises(ConnectionError):
        HostStaging(layout, "cpu", 1).send_host(get_backend("torch", "cpu"), caches(layout, 64, "cpu", 1), SRC_IDS, send)
    assert len(sent) == 1


def pull(transport: str, prefill_device: str, decode_device: str, **options):
    """One pull between two engines of this process; returns (source, destination) caches."""
    with create_connector(transport, "prefill", KVLayout(**LAYOUT, device=prefill_device), secret=SECRET,
                          engine_id="p", **options.get("prefill", {})) as prefill, \
            create_connector(transport, "decode", KVLayout(**LAYOUT, device=decode_device), secret=SECRET,
                             engine_id="d", **options.get("decode", {})) as decode:
        src = prefill.worker.allocate_kv_caches(64)
        pattern = caches(KVLayout(**LAYOUT), 64, "cpu", seed=11)
        for cache, values in zip(src, pattern):
            cache.copy_(values)
        dst = decode.worker.allocate_kv_caches(64)
        decode.start_pull("r", prefill.publish("r", SRC_IDS, len(SRC_IDS) * 8), DST_IDS)
        assert wait_events(decode, ["r"]).finished == ["r"]
        return [c.cpu() for c in src], [c.cpu() for c in dst]


def test_shm_through_host_buffers_on_cpu():
    """shm's GPU protocol (the prefill stages into its memfd mirror and says so; the decode copies
    through its own staging), forced on CPU caches."""
    src, dst = pull("shm", "cpu", "cpu", prefill=dict(host_staging=True), decode=dict(host_staging=True))
    assert blocks_bytes(dst, DST_IDS) == blocks_bytes(src, SRC_IDS)


@needs_cuda
@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("prefill_device,decode_device", [("cuda", "cpu"), ("cpu", "cuda"), ("cuda", "cuda")])
def test_gpu_and_cpu_engines_pull_from_each_other(transport, prefill_device, decode_device):
    src, dst = pull(transport, prefill_device, decode_device)
    assert blocks_bytes(dst, DST_IDS) == blocks_bytes(src, SRC_IDS)


@needs_cuda
def test_cuda_staging_many_chunks_bit_exact():
    layout = KVLayout(**LAYOUT, device="cuda")
    kernels = get_backend("auto", "cuda")
    src, dst = caches(layout, 64, "cuda", seed=5), caches(layout, 64, "cuda", seed=None)
    wire = []
    HostStaging(layout, "cuda", 3000).send_host(kernels, src, SRC_IDS, lambda host: wire.append(host.clone()))
    assert len(wire) > 1 and all(h.device.type == "cpu" for h in wire)
    chunks = iter(wire)
    HostStaging(layout, "cuda", 3000).recv_host(kernels, dst, DST_IDS, lambda host: host.copy_(next(chunks)))
    assert blocks_bytes([c.cpu() for c in dst], DST_IDS) == blocks_bytes([c.cpu() for c in src], SRC_IDS)
