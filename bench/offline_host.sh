#!/bin/bash
# bench/gateway_overhead.py on a host with no network (a bigger machine to measure on):
# everything it needs travels with the checkout in .offline/ (ignored by git).
#
#   bench/offline_host.sh pack [PYTHON_VERSION]    here, with PyPI reachable
#   bench/offline_host.sh run [ROUNDS] [WORKERS] [LOADS]    there, in the checkout
#
# pack: wheels for the host's Python (default 3.12, x86-64 Linux) of what the benchmark
# imports (the gateway, controllers, fake engines, load client; not the inference engine,
# nor the Kubernetes client or PostgreSQL driver, imported only when used) at the
# versions of this checkout's .venv, vllm-router with its own, and this machine's
# redis-server with the libraries Debian links it to that a host may lack. SKIP (names,
# separated by spaces) leaves out packages the host's Python already has.
# run: installs them under /tmp (nothing outside it), runs the benchmark with
# --router-env /tmp/router-env, and prints the table (also in $OUT/table.log when OUT is
# set). vllm-router's environment gets a stand-in py-spy that says it is missing: the
# host does not profile.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.offline
ROUTER_VERSION=$(sed -n 's/^ROUTER_VERSION = "\(.*\)"/\1/p' bench/gateway_overhead.py)
# What bench/gateway_overhead.py imports, directly or through the product.
NEEDS=(django djangorestframework drf-spectacular drf-spectacular-sidecar django-stubs-ext
       whitenoise channels channels-redis "uvicorn[standard]" prometheus-client redis hiredis
       httpx httptools orjson psutil pyyaml cryptography tqdm aiohttp pytest huggingface_hub)

pack() {
    local version=${1:-3.12}
    [ -x .venv/bin/pip ] || { echo "no .venv here: run make setup first" >&2; exit 1; }
    tmp=$(mktemp -d)  # global: the trap runs after the function has returned
    trap 'rm -rf "$tmp"' EXIT
    rm -rf "$DIR" && mkdir -p "$DIR/pool" "$DIR/redis"
    echo "== the benchmark's packages at this checkout's versions"
    .venv/bin/pip freeze --exclude-editable >"$tmp/pins.txt"
    python3 -m venv "$tmp/app" && python3 -m venv "$tmp/router"
    "$tmp/app/bin/pip" install -q --disable-pip-version-check -c "$tmp/pins.txt" "${NEEDS[@]}"
    "$tmp/router/bin/pip" install -q --disable-pip-version-check "vllm-router==$ROUTER_VERSION"
    local skip="pip setuptools ${SKIP:-}" name
    "$tmp/app/bin/pip" freeze >"$tmp/all.txt"
    # vllm-router's needs, but one version of each package: the benchmark's where both have it
    "$tmp/router/bin/pip" freeze | while read -r line; do
        grep -qi "^${line%%==*}==" "$tmp/all.txt" || echo "$line"
    done >>"$tmp/all.txt"
    for name in $skip; do
        grep -vi "^${name//[-_]/[-_]}==" "$tmp/all.txt" >"$tmp/kept.txt" || true
        mv "$tmp/kept.txt" "$tmp/all.txt"
    done
    echo "== wheels for Python $version: $(wc -l <"$tmp/all.txt") packages"
    local platforms=() n
    for n in 1 2010 2014 _2_5 _2_12 _2_17 _2_24 _2_27 _2_28 _2_31 _2_34; do
        platforms+=(--platform "manylinux${n}_x86_64")
    done
    .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps \
        --only-binary=:all: --python-version "$version" --implementation cp "${platforms[@]}" \
        -d "$DIR/pool" -r "$tmp/all.txt"
    echo "== redis-server and the libraries it needs beyond a base system"
    cp "$(command -v redis-server)" "$DIR/redis/"
    ldd "$(command -v redis-server)" | awk '/liblzf|libjemalloc/ {print $3}' \
        | xargs -r cp -t "$DIR/redis/"
    du -sh "$DIR"
}

run() {
    local rounds=${1:-4} workers=${2:-4} loads=${3:-} t0 site
    t0=$(date +%s)
    export PYTHONUNBUFFERED=1
    echo "== host: $(nproc) cores,$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)," \
         "$(free -g | awk '/Mem/ {print $2}') GiB, Linux $(uname -r), $(python3 -V)"
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
        "$DIR"/pool/*.whl
    site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
    export PYTHONPATH=/tmp/site:$site
    rm -rf /tmp/router-env
    python3 -m venv --without-pip /tmp/router-env
    python3 -m pip install -q --no-index --no-deps --no-compile --target \
        "$(/tmp/router-env/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        "$DIR"/pool/vllm_router-*.whl
    printf '%s\n' '#!/tmp/router-env/bin/python' 'import sys' \
        'from vllm_router.launch_router import main' 'sys.exit(main())' \
        >/tmp/router-env/bin/vllm-router
    printf '%s\n' '#!/bin/sh' 'echo "py-spy is not installed on this host" >&2' 'exit 1' \
        >/tmp/router-env/bin/py-spy
    chmod +x /tmp/router-env/bin/vllm-router /tmp/router-env/bin/py-spy
    mkdir -p /tmp/redis-bin && cp "$DIR/redis/redis-server" /tmp/redis-bin/
    export PATH=/tmp/redis-bin:$PATH LD_LIBRARY_PATH=$PWD/$DIR/redis
    redis-server --version
    echo "== ready in $(( $(date +%s) - t0 )) s"
    local args=(--rounds "$rounds" --workers "$workers" --router-env /tmp/router-env)
    [ -n "$loads" ] && args+=(--loads "$loads")
    python3 bench/gateway_overhead.py "${args[@]}" 2>&1 | tee "${OUT:-/tmp}/table.log"
    echo "== done in $(( $(date +%s) - t0 )) s"
}

case "${1:-}" in
    pack) shift; pack "$@" ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 pack [PYTHON_VERSION] | run [ROUNDS] [WORKERS] [LOADS]" >&2; exit 2 ;;
esac
