#!/usr/bin/env bash
# One-time, idempotent set-up of .venv/ with everything the demo, tests and benchmarks need.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(libturbojpeg0-dev libopencv-dev pkg-config)
PYTHON=${PYTHON:-python3}

missing_apt=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing_apt+=("$pkg")
done
if [ ${#missing_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing apt packages for FFCV: ${missing_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing_apt[@]}" >/dev/null
  else
    echo "setup: missing apt packages ${missing_apt[*]} (FFCV will not build); run as root or install them" >&2
  fi
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check --retries 10 --timeout 60)
# A dropped connection mid-download (DALI's wheel is ~420 MB) is retried from scratch, up to 3 times.
retry() {
  local attempt
  for attempt in 1 2 3; do
    "$@" && return 0
    echo "setup: attempt $attempt of: $* failed" >&2
    [ "$attempt" -lt 3 ] && sleep $((attempt * 15))
  done
  return 1
}
retry "${pip[@]}" --upgrade pip setuptools wheel
# A CPU build of torch 2.13.0 where one is available, so no multi-GB CUDA build is pulled.
"${pip[@]}" "torch==2.13.0" || echo "setup: torch==2.13.0 unavailable; pip resolves torch>=2.4 instead" >&2
# numpy, cython and pkgconfig must be present before FFCV's source build starts.
retry "${pip[@]}" numpy cython pkgconfig
retry "${pip[@]}" --no-build-isolation -e ".[dev,dali,ffcv]"
