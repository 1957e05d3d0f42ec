#!/usr/bin/env bash
# make test-arm: the tests that need no llama.cpp, run on aarch64 under QEMU user-mode emulation.
#
# A Debian arm64 root filesystem (debootstrap) with a venv of the project's dependencies from
# PyPI is built once under .cache/arm/ and reused; each run copies the working tree into it and
# runs tools/arm/tests.txt for several target CPUs. Needs Linux, root (chroot, mounts) and
# qemu-user-static + debootstrap, installed with apt-get when missing.
#   tools/arm/test.sh              build what is missing, then run tools/arm/tests.txt
#   tools/arm/test.sh ARGS...      the same, running `pytest ARGS` instead (ARM_CPU=name: for it)
#   tools/arm/test.sh --available  exit 0 when this machine can run them, else say why (exit 1)
# ARM_CPUS: the CPUs the kernel tests also run for (LLVM names; "" for none); ARM_JOBS: passes
# run at once (default: one a core).
set -euo pipefail
cd "$(dirname "$0")/../.."

CACHE=${ARM_CACHE:-.cache/arm}
ROOT=$CACHE/rootfs
SUITE=bookworm  # Python 3.11, as numpy/numba's aarch64 wheels need >= 3.10
MIRROR=${ARM_MIRROR:-http://deb.debian.org/debian}
READY=$ROOT/.edgeinfer-rootfs  # written last: a rootfs without it is half-built
VENV=/opt/venv                 # inside the rootfs
SRC=/src                       # the working tree's copy, inside the rootfs
PIP="PIP_CERT=/etc/ssl/certs/ca-certificates.crt pip"  # pip trusts certifi's CAs, not the system's
# qemu's CPU has every feature the target CPUs have; SVE registers of 256 bits as on Neoverse V1
# (qemu's default, 512, is A64FX's)
QEMU_CPU=max,sve-default-vector-length=32
NATIVE=$([ "$(uname -m)" = aarch64 ] && echo 1 || echo 0)

say() { echo "test-arm: $*"; }

# Why this machine cannot run the tests, or nothing when it can.
unavailable() {
    [ "$(uname -s)" = Linux ] || { echo "needs Linux (chroot + binfmt_misc)"; return; }
    [ "$(id -u)" = 0 ] || { echo "needs root (chroot, mounts, apt-get)"; return; }
    unshare --mount true 2>/dev/null || { echo "cannot make a mount namespace (a container?)"; return; }
    if [ $NATIVE = 0 ] && [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
        mount binfmt_misc -t binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null ||
            { echo "cannot mount binfmt_misc, which runs aarch64 programs (a container?)"; return; }
    fi
    command -v apt-get >/dev/null && return
    for tool in debootstrap rsync unshare $([ $NATIVE = 1 ] || echo qemu-aarch64-static); do
        command -v $tool >/dev/null || { echo "no $tool and no apt-get to install it"; return; }
    done
}

install_host_tools() {
    local missing=()
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    command -v rsync >/dev/null || missing+=(rsync)
    if [ $NATIVE = 0 ]; then
        command -v qemu-aarch64-static >/dev/null || missing+=(qemu-user-static)
        command -v update-binfmts >/dev/null || missing+=(binfmt-support)
    fi
    if [ ${#missing[@]} -gt 0 ]; then
        say "installing ${missing[*]} with apt-get"
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
    fi
}

# The kernel runs aarch64 binaries through qemu once binfmt_misc knows the interpreter; the F
# flag (Debian's default) opens it at registration, so the chroot needs no copy of qemu.
enable_binfmt() {
    [ $NATIVE = 1 ] && return
    local dir=/proc/sys/fs/binfmt_misc
    [ -e $dir/register ] || mount binfmt_misc -t binfmt_misc $dir
    [ -e $dir/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
    grep -q '^enabled' $dir/qemu-aarch64 || { say "qemu-aarch64 is not enabled in $dir"; exit 1; }
}

build_rootfs() {
    [ -e "$READY" ] && return
    say "building a Debian $SUITE arm64 root filesystem in $ROOT (once, a few minutes)"
    rm -rf "$ROOT"
    mkdir -p "$CACHE"
    debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,ca-certificates \
        "$SUITE" "$ROOT" "$MIRROR"
    touch "$READY"
}

# Runs a command inside the rootfs, in a private mount namespace (its mounts vanish with it, even
# when interrupted), with a clean environment plus the NAME=value words given first.
in_root() {
    unshare --mount --fork /bin/sh -ec '
        root=$1; shift
        mount -t proc proc "$root/proc"
        mount --rbind /dev "$root/dev"
        mount -t tmpfs tmpfs "$root/tmp"
        exec chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 QEMU_CPU='"$QEMU_CPU"' \
            PATH='"$VENV"'/bin:/usr/bin:/bin "$@"
    ' sh "$ROOT" "$@"
}

# The working tree (tracked and untracked files, not what .gitignore ignores) into $SRC. The
# ignored files already there stay: Numba's cache beside the sources (checked against them by
# kernels/cache_stamp.py, as on any checkout) and the synthetic models in tests/.cache.
copy_tree() {
    rsync -a --delete --exclude=/.git --filter=':- .gitignore' ./ "$ROOT$SRC/"
}

# The runtime dependencies and the test runner's (pyproject.toml's, llama-cpp-python aside: it
# would compile for an hour under emulation), from PyPI; brought up to date when pyproject.toml
# changes (the editable install maps its packages).
build_venv() {
    local key stamp=$ROOT$VENV/.edgeinfer-deps
    key=$(sha256sum < pyproject.toml | cut -c1-16)
    [ -e "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && return
    say "installing the dependencies from PyPI into the rootfs venv (a few minutes)"
    # the host's network setup: its resolver and trusted CAs (a TLS-inspecting proxy's included)
    cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
    local cas=/etc/ssl/certs/ca-certificates.crt
    [ ! -e $cas ] || cp -L $cas "$ROOT$cas"
    [ -e "$ROOT$VENV/pyvenv.cfg" ] || in_root python3 -m venv $VENV
    in_root $PIP install -q --upgrade pip
    local test_deps
    test_deps=$(in_root python3 -c '
import re, sys, tomllib
dev = tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["dev"]
print(" ".join(d for d in dev if re.match(r"(pytest|hypothesis)\b", d)))' $SRC/pyproject.toml)
    # shellcheck disable=SC2086
    in_root $PIP install -q -e $SRC $test_deps
    echo "$key" > "$stamp"
}

# The test list: tools/arm/tests.txt's lines for one group, comments and blank lines dropped.
selection() {
    sed -n "/^\[$1\]/,/^\[/p" tools/arm/tests.txt | grep -v -e '^\[' -e '^\s*#' -e '^\s*$'
}

# One pytest run on aarch64: run_tests CPU ARGS... (CPU "": the default, LLVM's generic ARMv8
# with NEON), after printing the target Numba compiles for; its 15 slowest tests are listed (where
# emulation's time goes).
# Under emulation LLVM's host detection reads the x86 host's /proc/cpuinfo and turns SVE, AES ...
# off; an empty NUMBA_CPU_FEATURES gives the named CPU its own.
run_tests() {
    local target=${1:+NUMBA_CPU_NAME=$1 NUMBA_CPU_FEATURES=}
    shift
    # shellcheck disable=SC2086
    in_root $target python -W error $SRC/tools/arm/cpu_info.py &&
        in_root $target sh -c "cd $SRC && exec python -m pytest -q -W error --durations=15 \"\$@\"" sh "$@"
}

# The passes: tools/arm/tests.txt's [every-cpu] on each of ARM_CPUS and on the default CPU, its
# [once] on the default CPU and [once-named] on the first of ARM_CPUS (the default CPU when none
# is named). Numba compiling under emulation is most of the time and uses one core, so each CPU's
# passes form a chain, its kernel pass first: the [once] groups then reuse the kernels that pass
# compiled (two passes compiling the same kernels side by side each pay for them). ARM_JOBS chains
# (default: one a core) run at once, the named CPUs' (the longest) first; each pass is logged to
# $CACHE/logs/ and shown when all end. Cold on 2 cores with cortex-a76: all of [once] after the
# default CPU's kernel pass took 1810 s, the named CPU's chain idle the last 230 s; split, the two
# chains end 20 s apart (1892 s on a slower day, whose kernel passes took 1725 and 1802 s).
run_passes() {
    local logs=$CACHE/logs chains=() cpu chain group n=0 first i rc secs failed=0
    local named=(${ARM_CPUS-cortex-a76 neoverse-v1})
    for cpu in "${named[@]}"; do chains+=("$cpu|every-cpu"); done
    chains+=("|every-cpu |once")
    chains[0]+=" ${named[0]:-}|once-named"  # the first chain: the first named CPU's, or the default's
    rm -rf "$logs"
    mkdir -p "$logs"
    for chain in "${chains[@]}"; do
        while [ "$(jobs -rp | wc -l)" -ge "${ARM_JOBS:-$(nproc)}" ]; do wait -n || true; done
        first=$((n + 1))
        n=$((n + $(wc -w <<< "$chain")))
        (
            i=$first
            for pass in $chain; do
                cpu=${pass%|*} group=${pass#*|}
                mapfile -t args < <(selection "$group")
                t=$SECONDS rc=0
                run_tests "$cpu" "${args[@]}" > "$logs/$i.log" 2>&1 || rc=$?
                echo "$rc $((SECONDS - t)) [$group] on ${cpu:-the default CPU}" > "$logs/$i.rc"
                i=$((i + 1))
            done
        ) &
    done
    wait
    for i in $(seq "$n"); do
        read -r rc secs pass < "$logs/$i.rc"
        cat "$logs/$i.log"
        say "$pass: $([ "$rc" = 0 ] && echo passed || echo FAILED) in $secs s"
        [ "$rc" = 0 ] || failed=1
    done
    return $failed
}

case "${1:-}" in
--available)
    why=$(unavailable)
    [ -z "$why" ] || { say "skipped: $why"; exit 1; }
    exit 0 ;;
-h | --help)
    sed -n '2,/^set /p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
    exit 0 ;;
esac
why=$(unavailable)
[ -z "$why" ] || { say "cannot run here: $why"; exit 2; }
install_host_tools
enable_binfmt
build_rootfs
copy_tree
build_venv
start=$SECONDS
# the kernels' cache check (kernels/cache_stamp.py) once here, not racing in passes run together;
# a warning on import is an error
in_root python -W error -c "import edgeinfer.kernels"
if [ $# -gt 0 ]; then
    run_tests "${ARM_CPU:-}" "$@"
else
    run_passes
fi
say "passed in $((SECONDS - start)) s"
