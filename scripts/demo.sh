#!/usr/bin/env bash
# provision's demo: three local test hosts (Docker containers with systemd and sshd), a real
# distributed training job applied to them, waited for, its status and the last lines of
# every task's log. The hosts stay up afterwards; the last lines say how to remove them.
#
#   bash scripts/demo.sh                         # PyTorch DDP: a chief and 2 workers
#   PROVISION_DEMO_EXAMPLE=tf_ps bash scripts/demo.sh
#
# PROVISION_DEMO_EXAMPLE: torch_ddp (default), reduction, tf_mwms, tf_ps -- the job files in
#   inventories/sandbox/. PROVISION_DEMO_NAME: the sandbox's name (default: demo).
#   PROVISION_DEMO_DIR: where the inventory, state and logs go (default: ./.demo).
# The first run on a machine installs Debian's docker.io and debootstrap, builds the host
# image (about a minute) and the framework layer (torch: a local or PyPI wheel;
# tensorflow-cpu: a 274 MB download); later runs reuse all of it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
T0=$(date +%s.%N)
# shellcheck source=scripts/setup.sh
source "$ROOT/scripts/setup.sh"

EXAMPLE="${PROVISION_DEMO_EXAMPLE:-torch_ddp}"
NAME="${PROVISION_DEMO_NAME:-demo}"
WORK="${PROVISION_DEMO_DIR:-$PWD/.demo}"
JOBFILE="$ROOT/inventories/sandbox/$EXAMPLE.yaml"
case "$EXAMPLE" in
    torch_ddp|reduction) FRAMEWORK=torch ;;
    tf_mwms|tf_ps) FRAMEWORK=tensorflow ;;
    *) echo "demo: PROVISION_DEMO_EXAMPLE=$EXAMPLE: choose torch_ddp, reduction, tf_mwms or tf_ps" >&2; exit 1 ;;
esac
INV="$WORK/inventory.yaml"
if [ -t 1 ]; then B=$'\033[1m' N=$'\033[0m'; else B="" N=""; fi
step() { printf '\n%s==> %s%s\n' "$B" "$*" "$N"; }
elapsed() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.0f} s')" "$1" "$(date +%s.%N)"; }

# A fresh start: an earlier demo's hosts and state (its hosts' keys, placement) go first,
# but only what this demo made: its marker in $WORK names the sandbox it brought up. A
# sandbox of that name without the marker is someone else's: refused, never removed.
MARK="$WORK/.made-by-provision-demo"
if provision sandbox list 2>/dev/null | awk 'NR>1 {print $1}' | grep -qx "$NAME"; then
    if [ "$(cat "$MARK" 2>/dev/null)" != "$NAME" ]; then
        echo "demo: a sandbox named '$NAME' exists and this demo did not make it (no marker in $WORK):" \
            "choose another with PROVISION_DEMO_NAME, or remove it: provision sandbox down --name $NAME" >&2
        exit 1
    fi
    step "removing the previous demo sandbox '$NAME'"
    provision sandbox down --name "$NAME"
fi
if [ -e "$WORK" ] && [ ! -e "$MARK" ]; then
    echo "demo: $WORK exists and this demo did not make it: choose another with PROVISION_DEMO_DIR" >&2
    exit 1
fi
rm -rf "$WORK"
mkdir -p "$WORK"
printf '%s\n' "$NAME" > "$MARK"

step "3 sandbox hosts with $FRAMEWORK, and an inventory for $(basename "$JOBFILE") on them"
provision sandbox up --hosts 3 --with "$FRAMEWORK" --name "$NAME" --from "$JOBFILE" -o "$INV"

step "provision apply -y --wait $INV"
T1=$(date +%s.%N)
rc=0
provision apply -y --wait --timeout 900 "$INV" || rc=$?
echo "(apply and wait: $(elapsed "$T1"))"

step "provision status $INV"
provision status "$INV" || true

step "provision logs $INV --tail 4"
provision logs "$INV" --tail 4 || true

step "done in $(elapsed "$T0")"
cat <<EOF
The job $( [ "$rc" -eq 0 ] && echo succeeded || echo "did NOT succeed (apply --wait exited $rc)" ). Try:
  provision status $INV
  provision logs $INV chief-0
  provision logs $INV -o $WORK/logs          # one file per task
  provision apply -y $INV                     # nothing to do: the finished job is not restarted
Tear down:
  provision destroy -y $INV && provision sandbox down --name $NAME
EOF
exit "$rc"
