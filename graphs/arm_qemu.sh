#!/bin/bash
# The aarch64 (NEON) path end to end on an x86 Debian 12 host, under qemu-user emulation:
# an arm64 CPython 3.11 from Debian's packages, aarch64 torch CPU wheels from PyPI, the kernel
# built by the host's cross compiler (which runs natively). It checks results, not speed.
#
#   graphs/arm_qemu.sh                         # tests/test_kernels.py under emulation
#   graphs/arm_qemu.sh tests/test_linear.py    # any pytest arguments
#
# Needs root for apt (the arm64 architecture, g++-aarch64-linux-gnu, qemu-user) on first use;
# everything else lives in $ARM_ROOT. torch: $ARM_TORCH (default 2.9.1, PyPI's aarch64 CPU
# build; PyPI's aarch64 2.13.0 is a CUDA build that pulls the CUDA toolkit).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
ARM_ROOT=${ARM_ROOT:-${FASTSPEC_CACHE:-$HOME/.cache/fastspec}/arm64}
ARM_TORCH=${ARM_TORCH:-2.9.1}
PIP=${PIP:-$REPO/.venv/bin/pip}
SYS=$ARM_ROOT/sysroot SITE=$ARM_ROOT/site-$ARM_TORCH PKG=$ARM_ROOT/pkg

if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
  apt-get install -y -q g++-aarch64-linux-gnu qemu-user
fi
if [ ! -x "$SYS/usr/bin/python3.11" ]; then
  dpkg --print-foreign-architectures | grep -qx arm64 || { dpkg --add-architecture arm64; apt-get update -q; }
  mkdir -p "$ARM_ROOT/debs" "$SYS"
  (cd "$ARM_ROOT/debs" && apt-get download $(printf '%s:arm64 ' python3.11-minimal libpython3.11-minimal \
    libpython3.11-stdlib libpython3.11-dev libbz2-1.0 libc6 libcrypt1 libdb5.3 libexpat1 libffi8 liblzma5 \
    libncursesw6 libnsl2 libreadline8 libsqlite3-0 libtinfo6 libtirpc3 libuuid1 zlib1g libssl3 libstdc++6 \
    libgcc-s1 libgomp1 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1))
  for deb in "$ARM_ROOT"/debs/*.deb; do dpkg -x "$deb" "$SYS"; done
fi
if [ ! -d "$SITE/torch" ]; then
  target=(--only-binary=:all: --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64
          --python-version 3.11 --implementation cp --target "$SITE")
  # torch without its dependency list (its x86-only CUDA markers would be read on this host).
  "$PIP" install -q "${target[@]}" --no-deps "torch==$ARM_TORCH"
  "$PIP" install -q "${target[@]}" filelock typing-extensions sympy networkx jinja2 fsspec numpy click \
    rich safetensors gguf pytest setuptools
fi
# fastspec as installed: fastspec.graphs/cli/evals come from graphs/, cli/, evals/ (pyproject).
mkdir -p "$PKG/fastspec" "$ARM_ROOT/include/aarch64-linux-gnu" "$ARM_ROOT/bin"
for f in "$REPO"/fastspec/*; do ln -sfn "$f" "$PKG/fastspec/"; done
for d in graphs cli evals; do ln -sfn "$REPO/$d" "$PKG/fastspec/$d"; done
# Python.h's multiarch pyconfig.h, without the rest of the arm64 sysroot's headers.
ln -sfn "$SYS/usr/include/aarch64-linux-gnu/python3.11" "$ARM_ROOT/include/aarch64-linux-gnu/python3.11"
cat > "$ARM_ROOT/bin/cxx" <<'EOF'
#!/bin/bash
# A cross compiler cannot resolve -march=native (inductor asks for it): an Armv8.2-A core instead.
args=()
for a in "$@"; do [[ "$a" == "-march=native" ]] && a="-march=armv8.2-a"; args+=("$a"); done
exec aarch64-linux-gnu-g++ "${args[@]}"
EOF
chmod +x "$ARM_ROOT/bin/cxx"

export PYTHONPATH=$PKG:$SITE CPLUS_INCLUDE_PATH=$ARM_ROOT/include CXX=$ARM_ROOT/bin/cxx CC=aarch64-linux-gnu-gcc
export FASTSPEC_CACHE=$ARM_ROOT/cache PYTHONDONTWRITEBYTECODE=1
cd "$ARM_ROOT"          # not the repo: its fastspec/ would shadow the installed layout above
[ $# -gt 0 ] || set -- tests/test_kernels.py
args=()
for a in "$@"; do [[ "$a" == tests/* ]] && a="$REPO/$a"; args+=("$a"); done
exec qemu-aarch64 -L "$SYS" "$SYS/usr/bin/python3.11" -m pytest -q -p no:cacheprovider --rootdir "$REPO" "${args[@]}"
