"""The slow-network harness: namespaces joined by veth pairs with tc tbf rate limits really limit gloo's bandwidth,
and nothing is left behind."""

import sys
import textwrap

import pytest

from hf_dtrain import processes
from hf_dtrain.testing import free_port
from hf_dtrain.testing.netns import available, emulated_hosts, run_on_hosts

OK, WHY = available()
pytestmark = pytest.mark.skipif(not OK, reason=f"no emulated network here ({WHY}); benchmarks fall back to loopback")

ALLREDUCE = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist
    from datetime import timedelta
    rank, world, addr, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    x = torch.ones(1_000_000)  # 4 MB
    dist.all_reduce(x)  # connect
    t = time.perf_counter(); dist.all_reduce(x); dt = time.perf_counter() - t
    assert torch.all(x == world ** 2)
    print(dt)
    dist.destroy_process_group()
""")


def _allreduce_seconds(tmp_path, n, rate):
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    port = str(free_port())
    with emulated_hosts(n, rate=rate) as hosts:
        names = [h.namespace for h in hosts]
        out = run_on_hosts(
            hosts, lambda r, hs: [sys.executable, str(script), str(r), str(n), hs[0].address, port], timeout=120
        )
    listed = processes.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)  # cleaned up
    return max(float(o) for o in out)


@pytest.mark.parametrize("n", [2, 3])
def test_tbf_limits_gloo_bandwidth_and_cleans_up(tmp_path, n):
    slow = _allreduce_seconds(tmp_path, n, "100mbit")
    fast = _allreduce_seconds(tmp_path, n, None)
    # every rank must receive at least (n - 1) / n of the 4 MB tensor: at 100 Mbit/s that takes >= 0.16 s (n = 2)
    assert slow >= 0.75 * (4e6 * 8 * (n - 1) / n) / 100e6
    assert fast < slow / 5


def test_bad_host_count():
    with pytest.raises(ValueError, match="2 to 4 hosts"), emulated_hosts(5):
        pass
