"""benchmarks/netem.py: a command under a capped rate really is slowed by it, refusals are one line with
exit status 2, and nothing is left behind on the host.

Needs root and a kernel that lets it make network namespaces and tbf qdiscs: probed once, the module is
skipped (with the reason) where it cannot. Every run is a subprocess with a timeout, so a hang fails.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
NETEM = os.path.join(HERE, "..", "benchmarks", "netem.py")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")

# 8 MiB of float32: one warm-up, then the median of 3 allreduces (each the slowest rank's time); and the hosts
ALLREDUCE = """
import array, socket, statistics, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
send, recv = array.array("f", bytes(8 << 20)), array.array("f", bytes(8 << 20))
comm.Allreduce(send, recv)
times = []
for _ in range(3):
    comm.Barrier()
    t = time.perf_counter()
    comm.Allreduce(send, recv)
    times.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
hosts = comm.gather(socket.gethostname())
if comm.rank == 0:
    print("seconds", statistics.median(times), "hosts", ",".join(hosts))
"""


def netem(*args, timeout=60):
    """Run netem; past `timeout` seconds, SIGTERM it (it passes the signal on and ends what is left) and fail."""
    proc = subprocess.Popen([sys.executable, NETEM, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"netem {' '.join(args[:4])} ... hung for {timeout} s: {err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module", autouse=True)
def namespaces_and_tc_permitted():
    """Skip the module unless this process may make a network namespace and cap its loopback with tbf."""
    if os.geteuid() != 0:
        pytest.skip("netem needs root")
    if not all(shutil.which(t) for t in ("unshare", "ip", "tc")):
        pytest.skip("unshare, ip or tc not installed")
    probe = ["unshare", "--net", "--", "sh", "-c",
             "ip link set lo up && tc qdisc add dev lo root tbf rate 1gbit burst 256kb latency 200ms"]
    r = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"network namespaces or tc not permitted here: {r.stderr.strip()}")


def host_network():
    """What netem must leave as it found it: the named namespaces and the host loopback's qdisc."""
    return (subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout,
            subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True, timeout=10).stdout)


def allreduce(rate, *options):
    """(seconds, hostnames by rank) of a 2-rank 8 MiB allreduce under `netem --rate RATE OPTIONS`."""
    r = netem("--rate", rate, *options, "--", MPIEXEC, "-n", "2", sys.executable, "-c", ALLREDUCE, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    seconds, hosts = re.search(r"seconds (\S+) hosts (\S+)", r.stdout).groups()
    return float(seconds), hosts.split(",")


@pytest.mark.slow
def test_allreduce_under_200mbit_takes_as_long_as_the_rate_says():
    pytest.importorskip("mpi4py")
    before = host_network()
    (unlimited, _), (capped, _) = allreduce("unlimited"), allreduce("200mbit")
    # 8 MiB each way through one shared 200 Mbit/s loopback: 16 MiB, 0.67 s; 0.3 s leaves room for any timer
    assert capped >= 0.3, f"200mbit: {capped:.3f} s for 8 MiB; the cap does not hold"
    assert capped >= 3 * unlimited, f"200mbit {capped:.3f} s against unlimited {unlimited:.3f} s"
    assert host_network() == before


@pytest.mark.slow
def test_two_nodes_have_a_capped_link_each_way():
    """One rank in each of two namespaces joined by a veth pair capped at 200 Mbit/s each way: 8 MiB each way,
    0.34 s; half the time of the loopback, where both directions share the rate."""
    pytest.importorskip("mpi4py")
    before = host_network()
    (unlimited, _), (capped, hosts) = allreduce("unlimited", "--nodes", "2"), allreduce("200mbit", "--nodes", "2")
    assert hosts == ["node0", "node1"]
    assert capped >= 0.15, f"200mbit between 2 nodes: {capped:.3f} s for 8 MiB; the cap does not hold"
    assert capped >= 3 * unlimited, f"200mbit {capped:.3f} s against unlimited {unlimited:.3f} s"
    assert host_network() == before


@pytest.mark.slow
def test_check_prints_the_allreduce_time():
    pytest.importorskip("mpi4py")
    r = netem("--rate", "unlimited", "--check", "--repeats", "1", timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"rate unlimited: 2-rank allreduce of 8 MiB: median \d+\.\d+ s", r.stdout), r.stdout


def test_command_sees_the_cap_and_mpich_over_tcp_and_its_exit_status_comes_back():
    show = "tc qdisc show dev lo; echo $MPIR_CVAR_NOLOCAL $MPIR_CVAR_CH4_NETMOD $FI_PROVIDER; exit 7"
    r = netem("--rate", "200mbit", "--burst", "1mb", "--", "sh", "-c", show)
    assert r.returncode == 7, r.stderr
    assert re.search(r"tbf .*rate 200Mbit", r.stdout), r.stdout
    assert "1 ofi tcp" in r.stdout
    r = netem("--rate", "unlimited", "--", "sh", "-c", show.replace("7", "0"))
    assert r.returncode == 0 and "tbf" not in r.stdout and "1 ofi tcp" in r.stdout, r.stdout + r.stderr


def test_latency_needs_netem_and_says_so_where_the_kernel_lacks_it():
    r = netem("--rate", "1gbit", "--latency", "5ms", "--", "tc", "qdisc", "show", "dev", "lo")
    if r.returncode == 0:  # a kernel with sch_netem: delay in front of the rate
        assert "netem" in r.stdout and "tbf" in r.stdout, r.stdout
    else:
        assert r.returncode == 2 and r.stderr.startswith("netem: error: --latency needs the netem qdisc"), r.stderr
        assert r.stderr.count("\n") == 1


@pytest.mark.parametrize("args,says", [
    (["--rate", "1gbit", "--burst", "64kb"], "a 64 KiB loopback packet would not fit"),
    (["--rate", "fast"], "--rate 'fast' does not parse"),
    (["--rate", "1gbit", "--burst", "lots"], "--burst 'lots' does not parse"),
    (["--rate", "1gbit", "--latency", "5"], "--latency '5' does not parse"),
])
def test_refusals_are_one_line_and_exit_2_without_running_the_command(tmp_path, args, says):
    marker = tmp_path / "ran"
    r = netem(*args, "--", "touch", str(marker))
    assert r.returncode == 2 and r.stderr.startswith("netem: error: ") and says in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert not marker.exists()


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")
def test_refuses_where_namespaces_are_not_permitted(tmp_path):
    """Root without CAP_SYS_ADMIN, as in many containers: found by trying, refused in one line."""
    marker = tmp_path / "ran"
    r = subprocess.run(["setpriv", "--bounding-set", "-sys_admin", "--", sys.executable, NETEM, "--rate", "1gbit",
                        "--", "touch", str(marker)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("netem: error: cannot create a network namespace here"), r.stderr
    assert r.stderr.count("\n") == 1 and not marker.exists()


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")
def test_refuses_when_not_root():
    r = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--", sys.executable,
                        NETEM, "--rate", "1gbit", "--", "true"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("netem: error: needs root"), r.stderr


def test_leaves_nothing_behind_even_what_the_command_left_running():
    before = host_network()
    r = netem("--rate", "1gbit", "--", "sh", "-c", "sleep 300 & readlink /proc/self/ns/net")
    assert r.returncode == 0, r.stderr
    netns = r.stdout.strip()
    assert netns.startswith("net:[") and netns != os.readlink("/proc/self/ns/net")
    left = [p for p in os.listdir("/proc") if p.isdigit() and _netns_of(p) == netns]
    assert left == [], f"processes {left} still in the namespace"
    assert host_network() == before


def _netns_of(pid):
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None
