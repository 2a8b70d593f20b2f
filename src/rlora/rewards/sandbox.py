"""Run untrusted Python (a model's completion plus its unit tests) in a separate, limited process.

Layers, each catching what the others might miss:
- a fresh interpreter (`python -I`: no user site, no PYTHON* variables) in a throwaway working directory,
  in its own session (the whole process group is killed on timeout), with a minimal environment, its
  output in a size-limited file;
- when rlora runs as root (containers, CI): the program runs as the unprivileged user nobody, so the kernel
  refuses writes to anything but its folder and world-writable places, and signals to other users' processes;
- resource limits: address space (memory), CPU seconds, file size, no core dumps;
- where the kernel allows it (root, or unprivileged user namespaces), a new empty network namespace;
- an audit hook (PEP 578) installed before the program runs, which cannot be removed from Python: it
  refuses process creation (fork, exec, spawn, subprocess, system), kill/killpg, sockets, ctypes and
  the native helper modules (under any dotted name), opening folders outside the working directory (so no
  directory descriptor can anchor a relative path), path operations relative to a folder descriptor, and
  any file write, rename, removal or permission change outside the working directory.
A program passes when it exits with status 0 within the time limit. This is a sandbox for model-written
test code. It is not a security boundary against hostile code: the audit hook is a Python-level layer
(other native modules, or a kernel exploit, can get past it), and without root there is no user switch.
Run untrusted code from people, not models, in a container or VM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

# The guard runs in the child, a fresh single-threaded interpreter: limits, network namespace, audit hook,
# then prog.py. The hook and its tables live only in a closure: the program cannot reach them from
# __main__, and the gc introspection that could find them is refused.
GUARD = r'''
import sys

def _limit(memory, cpu, fsize):
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

def _no_network():
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
            libc.unshare(0x10000000 | 0x40000000)  # with CLONE_NEWUSER, where unprivileged namespaces exist
    except OSError:
        pass  # the audit hook still refuses sockets
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]  # a later `import ctypes` is a real import again, which the hook refuses

def _install():
    import os
    root = os.path.realpath(os.getcwd())
    denied = frozenset({
        "os.system", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
        "os.kill", "os.killpg", "signal.pthread_kill", "socket.__new__", "socket.connect", "socket.bind",
        "socket.sendto", "socket.getaddrinfo", "socket.gethostbyname", "ctypes.dlopen", "ctypes.dlsym",
        "ctypes.cdata", "os.chroot", "os.setuid", "gc.get_objects", "gc.get_referrers", "gc.get_referents"})
    path_events = frozenset({"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.truncate", "os.chmod", "os.chown",
                             "os.symlink", "os.link", "os.utime", "shutil.rmtree", "os.chdir"})
    native = ("ctypes", "_ctypes", "cffi", "_posixsubprocess", "multiprocessing")
    write = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    realpath, fsdecode, sep, pathlike = os.path.realpath, os.fsdecode, os.sep, os.PathLike

    def inside(path):
        if isinstance(path, int):
            return True  # an already open descriptor
        real = realpath(fsdecode(path))
        return real == root or real.startswith(root + sep)

    # position of the dir_fd arguments of each path event: a relative path with a dir_fd would escape the
    # working-directory check
    dir_fds = {"os.rename": (2, 3), "os.link": (2, 3), "os.remove": (1,), "os.rmdir": (1,), "os.mkdir": (2,),
               "os.symlink": (2,), "os.chmod": (2,), "os.chown": (3,), "os.utime": (4,)}
    isdir = os.path.isdir

    def hook(event, args):
        if event in denied:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & write)
            if path is not None and not inside(path) and (writing or (not isinstance(path, int) and isdir(path))):
                raise PermissionError(f"sandbox: opening {path!r} (writing, or a folder) outside the sandbox is not allowed")
        elif event in path_events:
            if any(i < len(args) and args[i] is not None for i in dir_fds.get(event, ())):
                raise PermissionError(f"sandbox: {event} relative to a folder descriptor is not allowed")
            for path in args:
                if isinstance(path, (str, bytes, pathlike)) and not inside(path):
                    raise PermissionError(f"sandbox: {event} on {path!r} outside the sandbox is not allowed")
        elif event == "import" and any(part in native for part in args[0].split(".")):
            raise ImportError(f"sandbox: importing {args[0]} is not allowed")

    sys.addaudithook(hook)

_limit(*map(int, sys.argv[1:4]))
_no_network()
with open("prog.py", encoding="utf-8") as _f:
    _code = compile(_f.read(), "prog.py", "exec")
_install()
del _limit, _no_network, _install
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
'''


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0
    memory_mb: int = 512
    file_size_mb: int = 16


@dataclass(frozen=True)
class Outcome:
    passed: bool
    status: str  # passed, failed (non-zero exit), timeout, error (could not run)
    output: str  # the tail of stdout + stderr
    seconds: float


NOBODY = 65534  # the unprivileged user and group a root parent runs programs as


_AS_NOBODY = {"user": NOBODY, "group": NOBODY, "extra_groups": []}


@lru_cache(maxsize=1)
def interpreter() -> tuple[str, bool]:
    """-> (python to run programs with, whether it runs as nobody). As root, the first interpreter that the
    user nobody can start (this venv's lies under a private folder such as /root, so a system python is
    tried next); otherwise, or if none can, this interpreter as the current user."""
    if os.geteuid() == 0:
        for candidate in (os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"):
            try:
                check = subprocess.run([candidate, "-I", "-c", "import sys; assert sys.version_info >= (3, 8)"],
                                       capture_output=True, timeout=30, cwd="/", **_AS_NOBODY)
            except (OSError, subprocess.SubprocessError):
                continue
            if check.returncode == 0:
                return candidate, True
    return sys.executable, False


def _unprivileged(workdir: str, as_nobody: bool) -> dict:
    """Run as nobody:nogroup, owner of its working folder only, so the kernel itself refuses writes to the
    user's files and signals to the user's processes (only when rlora runs as root)."""
    if not as_nobody:
        return {}
    for path in (workdir, os.path.join(workdir, "prog.py")):
        os.chown(path, NOBODY, NOBODY)
    os.chmod(workdir, 0o700)
    return _AS_NOBODY


def run_program(source: str, limits: Limits = Limits()) -> Outcome:
    """Run `source` as a program in the sandbox. Never raises for anything the program does."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlora-sandbox-") as workdir:
        with open(os.path.join(workdir, "prog.py"), "w", encoding="utf-8") as handle:
            handle.write(source)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
               "PYTHONDONTWRITEBYTECODE": "1"}
        # output goes to a file the parent made (the child's file-size limit caps it): a program that prints
        # without end cannot fill the trainer's memory
        output_path = os.path.join(workdir, ".output")
        with open(output_path, "wb") as output:
            try:
                limits_args = [str(limits.memory_mb * 2**20), str(int(limits.timeout_s) + 1),
                               str(limits.file_size_mb * 2**20)]
                python, as_nobody = interpreter()
                proc = subprocess.Popen([python, "-I", "-c", GUARD, *limits_args], cwd=workdir, env=env,
                                        stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                        start_new_session=True, **_unprivileged(workdir, as_nobody))
            except OSError as err:
                return Outcome(False, "error", f"could not start the sandbox: {err}", time.perf_counter() - start)
            try:
                proc.wait(timeout=limits.timeout_s)
                status = "passed" if proc.returncode == 0 else "failed"
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.wait()
                status = "timeout"
            finally:
                _kill_group(proc)  # anything the program left behind in its session
        text = _tail(output_path, 2000)
    return Outcome(status == "passed", status, text, time.perf_counter() - start)


def _tail(path: str, size: int) -> str:
    with open(path, "rb") as handle:
        handle.seek(max(0, os.path.getsize(path) - size))
        return handle.read().decode("utf-8", errors="replace")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_programs(sources: list[str], limits: Limits = Limits(), workers: int | None = None) -> list[Outcome]:
    """Run several programs, up to `workers` (default: CPU count) at a time."""
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda source: run_program(source, limits), sources))
