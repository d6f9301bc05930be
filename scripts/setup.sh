#!/usr/bin/env bash
# Prepare this machine for provision's tests and sandbox: idempotent, as root on a fresh
# Debian machine (CI runs it from a fresh clone, with nothing installed by hand).
#
#   bash scripts/setup.sh          # or `source` it, as scripts/test.sh does
#
# 1. Debian packages: docker.io (the engine), debootstrap (builds the host image),
#    postgresql (tests of team state and shared studies start their own server on loopback)
#    and chromium with chromium-driver (the dashboard's browser test).
# 2. A running Docker engine: started in the background if `docker info` fails
#    (log: $PROVISION_DOCKERD_LOG, default /var/log/provision-dockerd.log).
# 3. inotify limits that let more than ~20 systemd containers boot.
# 4. provision itself, editable, with the test, tf and torch extras (CPU builds).
#
# PROVISION_SETUP_STEPS picks steps (default: "packages docker sysctl python");
# PROVISION_DOCKERD_FLAGS adds flags to a dockerd this script starts.
set -euo pipefail

_setup_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_setup_py="${PYTHON:-python3}"
_setup_log() { printf 'setup: %s\n' "$*" >&2; }

# Root for apt, dockerd and sysctl: directly, or through password-less sudo if there is one.
if [ "$(id -u)" -eq 0 ]; then
    _setup_sudo=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    _setup_sudo=(sudo -n)
else
    _setup_sudo=(false)
fi

_setup_packages() {
    local missing=()
    command -v dockerd >/dev/null 2>&1 || [ -x /usr/sbin/dockerd ] || missing+=(docker.io)
    command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || missing+=(debootstrap)
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql)
    # The dashboard's browser test (tests/integration/test_dashboard.py): chromium and its driver.
    command -v chromium >/dev/null 2>&1 || missing+=(chromium)
    command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "${_setup_sudo[*]}" = false ]; then
        _setup_log "need root to install ${missing[*]}: run this script as root"
        return 1
    fi
    _setup_log "installing ${missing[*]} (apt-get)"
    "${_setup_sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
    "${_setup_sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
}

_setup_engine_answers() {
    timeout 15 docker info >/dev/null 2>&1
}

_setup_docker() {
    _setup_engine_answers && return 0
    local log="${PROVISION_DOCKERD_LOG:-/var/log/provision-dockerd.log}"
    local pidfile=/var/run/docker.pid pid
    pid="$(cat "$pidfile" 2>/dev/null || true)"
    if [ -z "${PROVISION_DOCKERD_FLAGS:-}" ] && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        _setup_log "dockerd (pid $pid) is starting; waiting for it"
    elif [ -d /run/systemd/system ] && "${_setup_sudo[@]}" systemctl start docker 2>/dev/null; then
        _setup_log "started docker.service"
    else
        _setup_log "starting dockerd in the background (log: $log)"
        # setsid: the engine must outlive this shell and ignore its Ctrl-C.
        # One /24 per network instead of Docker's default /16s: room for 256 sandbox
        # networks at once (the default pools run out after about 30).
        # shellcheck disable=SC2086 # PROVISION_DOCKERD_FLAGS is a list of flags
        "${_setup_sudo[@]}" setsid nohup "$(command -v dockerd || echo /usr/sbin/dockerd)" \
            --default-address-pool base=10.213.0.0/16,size=24 \
            ${PROVISION_DOCKERD_FLAGS:-} >"$log" 2>&1 </dev/null &
    fi
    local i
    for i in $(seq 1 60); do
        _setup_engine_answers && return 0
        sleep 1
    done
    _setup_log "the Docker engine did not answer within 60 s; last lines of $log:"
    tail -n 20 "$log" >&2 2>/dev/null || true
    return 1
}

_setup_sysctl() {
    local key want current
    for key in fs.inotify.max_user_instances=8192 fs.inotify.max_user_watches=1048576; do
        want="${key#*=}"
        current="$(sysctl -n "${key%=*}" 2>/dev/null || echo 0)"
        if [ "$current" -lt "$want" ]; then
            "${_setup_sudo[@]}" sysctl -q -w "$key" >/dev/null 2>&1 \
                || _setup_log "warning: could not set $key (sandboxes past ~20 hosts may not boot)"
        fi
    done
}

_setup_python() {
    # Skip the pip run (10-30 s even when nothing changes) if this checkout's pyproject was
    # installed already and everything imports from here.
    local stamp_dir="${XDG_CACHE_HOME:-$HOME/.cache}/provision"
    local want
    want="$(sha256sum "$_setup_root/pyproject.toml" | cut -c1-16) $_setup_root"
    if [ "$(cat "$stamp_dir/setup-pip.stamp" 2>/dev/null)" = "$want" ] && "$_setup_py" - <<EOF 2>/dev/null
import importlib.util, sys, provision
ok = provision.__file__.startswith("$_setup_root/")
ok = ok and all(importlib.util.find_spec(m) for m in ("pytest", "docker", "fabric", "tensorflow", "torch", "ruff", "mypy"))
sys.exit(0 if ok else 1)
EOF
    then
        return 0
    fi
    _setup_log "pip install -e '.[test,tf,torch]'"
    "$_setup_py" -m pip install -q --disable-pip-version-check --root-user-action=ignore \
        -e "$_setup_root[test,tf,torch]"
    mkdir -p "$stamp_dir" && printf '%s\n' "$want" >"$stamp_dir/setup-pip.stamp"
}

for _setup_step in ${PROVISION_SETUP_STEPS:-packages docker sysctl python}; do
    "_setup_$_setup_step"
done
_setup_log "ready: $(docker version --format 'Docker engine {{.Server.Version}}' 2>/dev/null), $("$_setup_py" --version)"
