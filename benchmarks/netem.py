"""Run a command on an emulated network: a network namespace of its own whose links are capped by tc.

    python benchmarks/netem.py --rate 1gbit [--latency 0ms] [--burst 256kb] -- mpiexec -n 2 python x.py
    python benchmarks/netem.py --rate 200mbit --check      # times a 2-rank 8 MiB allreduce under the cap
    python benchmarks/netem.py --rate unlimited -- CMD     # the reference: the same MPI transport, no cap
    python benchmarks/netem.py --rate 1gbit --nodes 2 --procs-per-node 2 -- mpiexec -n 4 python x.py

Exit status: the command's (128 + N when signal N ended it); 2 with one `netem: error: ...` line when
it cannot run: not root, unshare/ip/tc missing, namespaces or tc not permitted here (found by trying),
a rate, size or time that does not parse, a burst below 65 KiB.

One node (the default). `unshare --net` starts the command in a fresh network namespace holding only
a loopback device, and `tc qdisc add dev lo root tbf rate R burst B latency 200ms` caps it. MPICH
would pass messages between ranks of one machine through shared memory, so the command's environment
turns that off and picks the libfabric TCP transport (MPIR_CVAR_NOLOCAL=1, MPIR_CVAR_CH4_NETMOD=ofi,
FI_PROVIDER=tcp): every byte between ranks crosses the capped loopback. One qdisc on one device: both
directions share the rate, as on a bus, not per-node links (a 2-rank ring allreduce of 8 MiB moves
16 MiB through it). tbf's `latency 200ms` bounds its queue (rate x 200 ms bytes; TCP backs off when it
overflows). `--burst` is how many bytes may pass at once at full speed; a packet larger than the burst
is dropped every time, so with the loopback's 64 KiB packets (65,550 bytes with the link header) a
64 KiB burst hangs TCP: 65 KiB is the least accepted. `--rate unlimited` keeps the namespace and the TCP
transport but adds no qdisc: the reference point.

Two nodes (`--nodes 2 --procs-per-node P`). Two namespaces, network and hostname: node0 (10.213.0.1)
and node1 (10.213.0.2), joined by a veth pair named eth0 on both sides, with the cap (one tbf) on each
side: a full-duplex link of the given rate each way, as between two machines. The command runs in
node0 with HYDRA_HOST_FILE listing both nodes with P slots each, HYDRA_IFACE=eth0 and a launcher that
enters node1's namespaces in place of ssh, so a plain `mpiexec -n 2P ...` places ranks 0..P-1 on node0
and the rest on node1. Inside a node MPICH keeps shared memory; between nodes it uses TCP over eth0
(FI_TCP_IFACE=eth0). The launcher is a small script in a temporary directory, removed at exit.

--latency adds a one-way delay to every packet with the netem qdisc in front of tbf. Kernels without
sch_netem (this project's reference machine has none) refuse it, found by trying, exit 2.

Nothing is left behind: the namespaces are anonymous (never in `ip netns list`), the qdiscs and the
veth pair live inside them, and the kernel frees them all when their last process exits; processes the
command leaves running in them are ended (SIGTERM, then SIGKILL after 3 s) when it returns, and the
command itself is killed if netem is (PR_SET_PDEATHSIG). The host's own network, its loopback included,
is never touched. Standard library only.
"""

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

MPICH_OVER_TCP = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
MIN_BURST = 65 * 1024  # a 64 KiB loopback packet plus its link header and tc's rounding; 64 KiB hangs here
QUEUE_LATENCY = "200ms"  # tbf's queue bound, the value measured to work here
NODE_ADDRESSES = ("10.213.0.1", "10.213.0.2")  # private to the namespaces: the host never sees them

RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
              "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
              "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12}
SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
              "g": 2**30, "gb": 2**30, "gib": 2**30}
TIME_UNITS = {"s": 10**6, "sec": 10**6, "ms": 10**3, "msec": 10**3, "us": 1, "usec": 1}

# Run under mpiexec by --check: 2 ranks, 8 MiB of float32, one warm-up (it opens the connections), then
# repeats; a repeat's time is its slowest rank's. Needs mpi4py in the Python running netem.py.
ALLREDUCE_CHECK = """
import array, statistics, sys, time
from mpi4py import MPI
comm, repeats, label = MPI.COMM_WORLD, int(sys.argv[1]), sys.argv[2]
send, recv = array.array("f", bytes(8 << 20)), array.array("f", bytes(8 << 20))
comm.Allreduce(send, recv)
times = []
for _ in range(repeats):
    comm.Barrier()
    t = time.perf_counter()
    comm.Allreduce(send, recv)
    times.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
if comm.rank == 0:
    print(f"netem: {label}: {comm.size}-rank allreduce of 8 MiB: median {statistics.median(times):.3f} s, "
          f"min {min(times):.3f} s over {repeats} repeats")
"""


class Refused(Exception):
    """A reason not to run the command, printed as one `netem: error: ...` line (exit status 2)."""


def parse_quantity(text, units, option, examples):
    """'200mbit' -> 200e6 with units={'mbit': 1e6, ...}; Refused naming the option when it does not parse."""
    m = re.fullmatch(r"(\d+(?:\.\d*)?)([a-z]*)", text.strip().lower())
    if not m or m.group(2) not in units:
        names = ", ".join(u for u in units if u)
        raise Refused(f"{option} {text!r} does not parse: expected a number with a unit ({names}), e.g. {examples}")
    return float(m.group(1)) * units[m.group(2)]


def parse_rate(text):
    """Bits per second as an int, or None for 'unlimited'. Units as tc's: kbit = 1000 bit/s, kbps = 1000 bytes/s."""
    if text.strip().lower() == "unlimited":
        return None
    bits = int(parse_quantity(text, RATE_UNITS, "--rate", "1gbit, 200mbit, 10mbps or unlimited"))
    if bits < 1000:
        raise Refused(f"--rate {text!r} is {bits} bit/s; expected at least 1kbit")
    return bits


def parse_burst(text):
    """Bytes as an int (k, m, g: powers of 1024, as tc's), at least MIN_BURST."""
    nbytes = int(parse_quantity(text, SIZE_UNITS, "--burst", "256kb, 1mb"))
    if nbytes < MIN_BURST:
        raise Refused(f"--burst {text!r} is {nbytes} bytes: a 64 KiB loopback packet would not fit, tbf would drop "
                      f"every full-size packet and TCP would hang; use at least 65kb ({MIN_BURST} bytes)")
    return nbytes


def parse_latency(text):
    """Microseconds as an int; a bare 0 is allowed."""
    if text.strip() == "0":
        return 0
    return int(parse_quantity(text, TIME_UNITS, "--latency", "0ms, 5ms, 100us"))


def qdisc_commands(dev, rate_bits, burst_bytes, delay_us):
    """The tc command lines that cap `dev`: netem (delay) in front of tbf (rate), either one alone, or none."""
    commands, parent = [], ["root"]
    if delay_us:
        commands.append(["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{delay_us}us",
                         "limit", "100000"])
        parent = ["parent", "1:1"]
    if rate_bits is not None:
        commands.append(["tc", "qdisc", "add", "dev", dev, *parent, "handle", "10:", "tbf", "rate", f"{rate_bits}bit",
                         "burst", str(burst_bytes), "latency", QUEUE_LATENCY])
    return commands


def setup_script(steps, stderr_fd, then):
    """sh script: run each step (an argv list), writing `netem-failed: STEP` and exiting 2 at the first that fails;
    then write `netem-ready NETNS` and give the command the real stderr (fd `stderr_fd`). Until then stderr is
    the pipe netem reads, so a failure's message (unshare's included) reaches netem, not the user."""
    lines = [f"{shlex.join(s)} || {{ echo {shlex.quote('netem-failed: ' + shlex.join(s))} >&2; exit 2; }}"
             for s in steps]
    lines += ['echo "netem-ready $(readlink /proc/self/ns/net)" >&2', f"exec 2>&{stderr_fd} {stderr_fd}>&-", then]
    return "\n".join(lines)


def start_in_namespace(unshare_args, steps, then, command, env, stdin=None):
    """Start `unshare UNSHARE_ARGS sh -c SCRIPT netem COMMAND...`; returns (process, netns) once the steps have
    run (netns: the namespace's id, 'net:[N]'). Raises Refused with the failing step's message."""
    read_end, write_end = os.pipe()
    real_stderr = os.dup(2)
    try:
        proc = subprocess.Popen(["unshare", *unshare_args, "--", "sh", "-c",
                                 setup_script(steps, real_stderr, then), "netem", *command],
                                stdin=stdin, stderr=write_end, pass_fds=(real_stderr,), env=env,
                                preexec_fn=die_with_parent)
    finally:
        os.close(write_end)
        os.close(real_stderr)
    with os.fdopen(read_end, errors="replace") as pipe:
        lines = [ln for ln in pipe.read().splitlines() if ln.strip()]  # EOF: the command started, or setup failed
    if lines and lines[-1].startswith("netem-ready "):
        for ln in lines[:-1]:  # warnings from ip or tc
            print(f"netem: {ln}", file=sys.stderr)
        return proc, lines[-1].split(" ", 1)[1]
    proc.wait()
    raise Refused(explain_setup_failure(lines))


def explain_setup_failure(lines):
    """One line from what the setup wrote: which step failed, with its own message."""
    failed = [ln[len("netem-failed: "):] for ln in lines if ln.startswith("netem-failed: ")]
    said = "; ".join(ln for ln in lines if not ln.startswith("netem-failed: ")) or "no message"
    if not failed:
        return f"cannot create a network namespace here ({said}); it needs root with CAP_SYS_ADMIN"
    return explain_failed_step(failed[0], said)


def explain_failed_step(step, said):
    """One line for a setup command `step` (a string) that failed with the message `said`."""
    if " netem " in step and "unknown" in said.lower():
        return f"--latency needs the netem qdisc, which this kernel lacks ({said}); use --latency 0ms"
    return f"`{step}` failed in the namespace ({said}); tc needs CAP_NET_ADMIN and the tbf qdisc"


def die_with_parent():
    """In the child before exec: SIGKILL it when netem dies, even of SIGKILL, so no command outlives netem."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def processes_in(netns):
    """Pids of the live processes whose network namespace is `netns` ('net:[N]')."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/net") == netns:
                    pids.append(int(entry))
            except OSError:  # gone, or a zombie
                pass
    return pids


def end_leftovers(namespaces):
    """SIGTERM, then SIGKILL after 3 s, what the command left running in its namespaces; the last process of a
    namespace gone, the kernel frees it with its devices and qdiscs."""
    for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 1.0)):
        pids = [p for ns in namespaces for p in processes_in(ns)]
        if not pids:
            return
        print(f"netem: sending {sig.name} to {len(pids)} process(es) left in the namespace", file=sys.stderr)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(processes_in(ns) for ns in namespaces):
            time.sleep(0.05)


def wait_forwarding_signals(proc):
    """proc's exit status as a shell gives it (128 + N for signal N); SIGINT, SIGTERM and SIGHUP sent to netem
    go on to the command."""
    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, lambda signum, frame: proc.send_signal(signum)) for s in forwarded}
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code


def run_one_node(command, env, rate_bits, burst_bytes, delay_us):
    """COMMAND in a namespace of its own whose loopback is capped; its exit status."""
    steps = [["ip", "link", "set", "lo", "up"], *qdisc_commands("lo", rate_bits, burst_bytes, delay_us)]
    proc, netns = start_in_namespace(["--net"], steps, 'exec "$@"', command, {**env, **MPICH_OVER_TCP})
    try:
        return wait_forwarding_signals(proc)
    finally:
        end_leftovers([netns])


LAUNCHER = """#!/bin/sh
# hydra's ssh launcher calls: LAUNCHER [-x] HOST COMMAND...; run COMMAND in HOST's namespaces instead.
[ "$1" = "-x" ] && shift
host=$1; shift
case "$host" in
{cases}
  *) echo "netem launcher: unknown host $host" >&2; exit 255 ;;
esac
exec nsenter --net=/proc/$pid/ns/net --uts=/proc/$pid/ns/uts -- sh -c "$*"
"""


def run_two_nodes(command, env, rate_bits, burst_bytes, delay_us, procs_per_node):
    """COMMAND in node0 of two namespaces joined by a capped veth pair, hydra set to start ranks on both."""
    holders, namespaces = [], []
    with tempfile.TemporaryDirectory(prefix="netem-") as tmp:
        try:
            for i in range(len(NODE_ADDRESSES)):  # each node: a shell waiting on stdin, which holds the namespaces
                steps = [["hostname", f"node{i}"], ["ip", "link", "set", "lo", "up"]]
                proc, netns = start_in_namespace(["--net", "--uts"], steps, "exec cat >/dev/null", [], env,
                                                 stdin=subprocess.PIPE)
                holders.append(proc)
                namespaces.append(netns)
            pids = [h.pid for h in holders]
            enter = [["nsenter", f"--net=/proc/{pid}/ns/net", "--"] for pid in pids]
            run_steps([[*enter[0], "ip", "link", "add", "eth0", "type", "veth", "peer", "name", "eth0",
                        "netns", str(pids[1])]])
            for i, address in enumerate(NODE_ADDRESSES):
                run_steps([[*enter[i], "ip", "addr", "add", f"{address}/24", "dev", "eth0"],
                           [*enter[i], "ip", "link", "set", "eth0", "up"]])
            for i in range(len(pids)):
                raise_carrier(enter[i])
                run_steps([[*enter[i], *c] for c in qdisc_commands("eth0", rate_bits, burst_bytes, delay_us)])

            hostfile, launcher = os.path.join(tmp, "hosts"), os.path.join(tmp, "launcher")
            with open(hostfile, "w") as f:
                f.writelines(f"{address}:{procs_per_node}\n" for address in NODE_ADDRESSES)
            with open(launcher, "w") as f:
                cases = "\n".join(f"  {a}) pid={p} ;;" for a, p in zip(NODE_ADDRESSES, pids, strict=True))
                f.write(LAUNCHER.format(cases=cases))
            os.chmod(launcher, 0o755)
            node_env = {**env, "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0",
                        "HYDRA_HOST_FILE": hostfile, "HYDRA_IFACE": "eth0", "HYDRA_LAUNCHER": "ssh",
                        "HYDRA_LAUNCHER_EXEC": launcher}
            node_env.pop("MPIR_CVAR_NOLOCAL", None)  # shared memory inside a node, as on a real one
            proc = subprocess.Popen(["nsenter", f"--net=/proc/{pids[0]}/ns/net", f"--uts=/proc/{pids[0]}/ns/uts", "--",
                                     *command], env=node_env, preexec_fn=die_with_parent)
            return wait_forwarding_signals(proc)
        finally:
            for h in holders:
                h.stdin.close()  # the holder's cat sees EOF and exits
            for h in holders:
                try:
                    h.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            end_leftovers(namespaces)
            for h in holders:
                h.wait()


def raise_carrier(enter):
    """Make eth0 of the node `enter` (an nsenter prefix) report a carrier. Here the veth end brought up last can
    stay NO-CARRIER although both ends are up (packets pass, but libfabric skips an interface that is not
    RUNNING, and MPI_Init fails); taking it down and up again fixes it."""
    for _ in range(5):
        r = subprocess.run([*enter, "ip", "-o", "link", "show", "eth0"], capture_output=True, text=True)
        if r.returncode == 0 and "NO-CARRIER" not in r.stdout:
            return
        run_steps([[*enter, "ip", "link", "set", "eth0", "down"], [*enter, "ip", "link", "set", "eth0", "up"]])
        time.sleep(0.1)
    raise Refused(f"the veth pair between the nodes stays without a carrier: {r.stdout.strip() or r.stderr.strip()}")


def run_steps(steps):
    """Run each argv on the host side (nsenter into a node); Refused at the first that fails, with its message."""
    for step in steps:
        r = subprocess.run(step, capture_output=True, text=True)
        if r.returncode != 0:
            said = "; ".join(ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip())
            said = said or f"exit status {r.returncode}"
            raise Refused(explain_failed_step(shlex.join(step), said))


def find_mpiexec():
    """The mpiexec next to this Python (the venv's mpich), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")
    if not found:
        raise Refused(f"--check needs mpiexec, found neither next to {sys.executable} nor on PATH")
    return found


class OneLineErrors(argparse.ArgumentParser):
    """Usage mistakes as one `netem: error: ...` line, exit status 2, like every other refusal."""

    def error(self, message):
        self.exit(2, f"netem: error: {message} (see --help)\n")


def parse_args(argv):
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    else:
        command = []
    p = OneLineErrors(prog="netem", description=__doc__.split("\n\n")[0],
                      usage="python benchmarks/netem.py --rate RATE [options] (--check | -- COMMAND ...)")
    p.add_argument("--rate", required=True, help="link rate: 1gbit, 200mbit, 10mbps (bytes/s) or unlimited")
    p.add_argument("--burst", default="256kb", help="tbf bucket, at least 65kb (default 256kb)")
    p.add_argument("--latency", default="0ms", help="one-way delay per packet, needs sch_netem (default 0ms)")
    p.add_argument("--check", action="store_true", help="time a 2-rank 8 MiB allreduce under the cap and exit")
    p.add_argument("--repeats", type=int, default=5, help="timed allreduces of --check (default 5)")
    p.add_argument("--nodes", type=int, default=1, choices=(1, 2), help="1: capped loopback; 2: a capped veth pair")
    p.add_argument("--procs-per-node", type=int, default=1, help="MPI slots per node with --nodes 2 (default 1)")
    args = p.parse_args(argv)
    if args.check == bool(command):
        p.error("give either --check or -- COMMAND ...")
    args.command = command
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        rate_bits, burst_bytes, delay_us = parse_rate(args.rate), parse_burst(args.burst), parse_latency(args.latency)
        if args.procs_per_node < 1 or (args.procs_per_node != 1 and args.nodes == 1):
            raise Refused(f"--procs-per-node {args.procs_per_node}: expected at least 1, and only with --nodes 2")
        if os.geteuid() != 0:
            raise Refused(f"needs root (uid {os.geteuid()} here): network namespaces and tc need CAP_SYS_ADMIN "
                          f"and CAP_NET_ADMIN")
        tools = ["unshare", "ip", "tc", "sh"] + (["nsenter", "cat", "hostname"] if args.nodes == 2 else [])
        missing = [t for t in tools if shutil.which(t) is None]
        if missing:
            raise Refused(f"{', '.join(missing)} not found on PATH (util-linux and iproute2 provide them)")
        command = args.command
        if args.check:
            n = 2 if args.nodes == 1 else 2 * args.procs_per_node
            label = f"rate {args.rate}" + (f", 2 nodes x {args.procs_per_node}" if args.nodes == 2 else "")
            command = [find_mpiexec(), "-n", str(n), sys.executable, "-c", ALLREDUCE_CHECK, str(args.repeats), label]
        env = dict(os.environ)
        if args.nodes == 2:
            return run_two_nodes(command, env, rate_bits, burst_bytes, delay_us, args.procs_per_node)
        return run_one_node(command, env, rate_bits, burst_bytes, delay_us)
    except Refused as e:
        print(f"netem: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
