"""The decode-overhead benchmark's setup (model, pool, batches) runs on the CPU."""

from bench.lora_decode_overhead import smoke


def test_lora_decode_overhead_setup_runs_on_cpu():
    smoke()
