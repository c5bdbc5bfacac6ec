"""The wheel's console commands (pyproject.toml [project.scripts]).

`eaglekit` execs the installed bin/eaglekit with the same arguments (it execs bin/eaglekit-torch
for the commands that need LibTorch), after checking that the torch installed is the one the
binaries were built against (eaglekit_build_info.json, written by the build). eaglekit-torch finds
torch's libraries by its RPATH, $ORIGIN/../../torch/lib and the NVIDIA wheels' folders beside
torch, set at link time; only when torch is installed in another site-packages than eaglekit
(a venv with --system-site-packages, a user install) does the launcher put that torch's
library folders on LD_LIBRARY_PATH, saying so with --verbose. `eaglekit demo` runs the
built-in example (the repository's scripts/demo, installed with the wheel) on these binaries.

eaglekit-regenerate, eaglekit-dump and eaglekit-masks run the repository's
tools/python/eaglekit_{regenerate,dump,masks}.py; what they import is the `dump` extra:
pip install 'eaglekit[dump]'.
"""
import glob
import importlib.metadata
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.join(HERE, "bin")
SHARE = os.path.join(HERE, "share", "eaglekit")


def _die(msg, code=1):
    sys.stderr.write(f"eaglekit: {msg}\n")
    return code


def build_info():
    """The version, git commit, torch and CUDA the binaries were built with."""
    with open(os.path.join(HERE, "eaglekit_build_info.json"), encoding="utf-8") as f:
        return json.load(f)


def torch_problem(info):
    """None when the installed torch is the one the binaries link, else what is wrong."""
    want = info["torch"]
    try:
        have = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return (f"torch is not installed in this Python ({sys.executable}); eaglekit's binaries link "
                f"torch {want}'s LibTorch: pip install torch=={want}")
    if not have:  # a dist-info folder without readable METADATA
        return f"torch's package metadata in this Python ({sys.executable}) is unreadable: reinstall torch=={want}"
    if have.split("+")[0] != want:
        return (f"torch {have} is installed ({sys.executable}), but eaglekit {info['version']} was built "
                f"against torch {want} and links its LibTorch by exact version: pip install torch=={want} "
                f"(or build eaglekit's wheel against torch {have.split('+')[0]}: scripts/wheel)")
    return None


def _torch_library_env(env, verbose):
    """LD_LIBRARY_PATH for a torch installed away from eaglekit (the RPATH covers the sibling case)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return
    torch_dir = os.path.abspath(list(spec.submodule_search_locations)[0])
    site = os.path.dirname(torch_dir)
    if site == os.path.dirname(HERE):
        return  # eaglekit-torch's RPATH finds it
    dirs = [os.path.join(torch_dir, "lib")] + sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib")))
    old = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = ":".join(dirs + ([old] if old else []))
    if verbose:
        sys.stderr.write(f"eaglekit: torch is in {site}, not beside eaglekit: LD_LIBRARY_PATH={env['LD_LIBRARY_PATH']}\n")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        info = build_info()
    except (OSError, ValueError, KeyError) as e:
        return _die(f"this installation is broken: {e}; reinstall the wheel")
    problem = torch_problem(info)
    if problem:
        if argv[:1] == ["--version"]:
            sys.stderr.write(f"eaglekit: warning: {problem}\n")
        else:
            return _die(problem)
    env = dict(os.environ)
    _torch_library_env(env, "-v" in argv or "--verbose" in argv)
    if argv[:1] == ["demo"]:
        if len(argv) > 1 and argv[1] in ("-h", "--help"):
            print("usage: eaglekit demo\n\nThe built-in example on the CPU (synth, index, validate, vocab, train, evaluate,\n"
                  "export, report), as the repository's scripts/demo; exits 1 when the draft did not learn.\n"
                  "Environment: EAGLEKIT_DEMO_DIR, EAGLEKIT_DEMO_STEPS, EAGLEKIT_DEMO_SEED, EAGLEKIT_DEMO_LR.")
            return 0
        if len(argv) > 1:
            return _die(f"demo takes no arguments (got {' '.join(argv[1:])}); see eaglekit demo --help", 2)
        if env.get("EAGLEKIT_DEMO_DIR"):  # the script changes folder: a relative path is the caller's
            env["EAGLEKIT_DEMO_DIR"] = os.path.abspath(env["EAGLEKIT_DEMO_DIR"])
        env["EAGLEKIT_BIN_DIR"] = BIN
        env["EAGLEKIT_DEMO_PYTHON"] = sys.executable
        demo = os.path.join(SHARE, "demo")
        os.execve("/bin/bash", ["bash", demo, "--no-build"], env)
    binary = os.path.join(BIN, "eaglekit")
    if argv[:1] in (["-h"], ["--help"]) or not argv:
        sys.stderr.write("(from the wheel: `eaglekit demo` runs the built-in example)\n")
    try:
        os.execve(binary, [binary] + argv, env)
    except OSError as e:
        return _die(f"cannot run {binary}: {e.strerror}; reinstall the wheel")


def _tool(name):
    sys.path.insert(0, os.path.join(SHARE, "python"))
    try:
        module = __import__(name)
    except ModuleNotFoundError as e:
        return _die(f"{name.replace('_', '-')}: {e}: pip install 'eaglekit[dump]' installs what it imports")
    return module.main()


def regenerate():
    return _tool("eaglekit_regenerate")


def dump():
    return _tool("eaglekit_dump")


def masks():
    return _tool("eaglekit_masks")
