# Debian's chromium for the web view's browser test (tests/integration/worker/test_web.py).
# Source it after _env.sh. Installs the chromium package with apt-get when it is missing and
# this runs as root with apt; under CI a chromium that cannot be had is a failure, elsewhere
# the browser test skips (with its reason).
if [[ ! -x ${LEASES_CHROMIUM:-/usr/bin/chromium} ]]; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "==> installing chromium with apt-get (the web view's browser test)"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    fi
fi
if [[ -x ${LEASES_CHROMIUM:-/usr/bin/chromium} ]]; then
    echo "==> chromium: $("${LEASES_CHROMIUM:-/usr/bin/chromium}" --version 2>/dev/null || echo found)"
elif [[ -n ${CI:-} ]]; then
    echo "no chromium at ${LEASES_CHROMIUM:-/usr/bin/chromium} and none could be installed" \
        "(CI is set, so this is a failure)" >&2
    exit 1
else
    echo "==> chromium: none (the web view's browser test will skip)"
fi
