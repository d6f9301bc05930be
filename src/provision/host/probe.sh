# provision's fast probe: what plan reads from a host, without starting Python.
#
# Run by probe.py as:  sh -c "<this file>" provision-probe MAX PROPS UNITS GPUS TPU PATH...
#   MAX    content of regular files up to MAX+1 bytes each is sent back (for diffs)
#   PROPS  the unit properties to show, comma-separated (agent.UNIT_PROPS)
#   UNITS  unit names, separated by spaces (the controller checks they are plain names)
#   GPUS   empty, or "SECONDS COMMAND...": nvidia-smi's query (agent.NVIDIA_SMI) and its timeout
#   TPU    empty, or 1 to count /dev/accelN
#   PATH   files to report: managed files, manifest, lifecycle marker, exit records
# Read-only. Each section is framed so probe.py can check it adds up; when anything does
# not (a file changed size between stat and head, say), the controller asks the Python agent.
# Costs one sh and four execs (stat, sha256sum, head, systemctl), about half of a Python
# start-up plus the agent, which matters on the host's CPU at every plan.
# No single quotes and no backslashes here: the whole file travels in one single-quoted word
# (which every login shell, fish included, passes on unchanged).
set -f
max=$1
props=$2
units=$3
gpus=$4
tpu=$5
shift 5
echo @probe 1
if [ -d /run/systemd/system ]; then echo @systemd; fi
if [ -n "$gpus" ]; then
    out=$(timeout $gpus 2>/dev/null </dev/null)
    echo @gpus $?
    printf %s "$out"
    echo
    echo @gpus-end
fi
if [ -n "$tpu" ]; then
    n=0
    set +f
    for d in /dev/accel*; do
        case ${d#/dev/accel} in ""|*[!0-9]*) ;; *) n=$((n + 1)) ;; esac
    done
    set -f
    echo @tpu $n
fi
echo @stat
if [ $# -gt 0 ]; then stat -c "%s %f %u %n" -- "$@" 2>/dev/null </dev/null; fi
# Regular files only (never a fifo someone left in the way): moved behind the others.
n=$#
for p do
    if [ -f "$p" ] && [ ! -h "$p" ]; then set -- "$@" "$p"; fi
done
shift $n
echo @sha256 $#
if [ $# -gt 0 ]; then sha256sum -- "$@" </dev/null; fi
echo @content
if [ $# -gt 0 ]; then head -q -c $((max + 1)) -- "$@" </dev/null; fi
echo @units
if [ -n "$units" ]; then
    systemctl show "--property=$props" -- $units </dev/null
fi
echo @end
