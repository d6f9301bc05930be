# provision's fast probe: what plan reads from a host, without starting Python.
#
# Run by probe.py as:
#   sh -c "<this file>" provision-probe MAX PROPS UNITS GPUS TPU TENANCY CLOCK APPS PORTS DISK RESOLVE LOOK KNOWN DROPINS HEALTH LOGINS PROGRESS PATH...
#   MAX    content of regular files up to MAX+1 bytes each is sent back (for diffs)
#   PROPS  the unit properties to show, comma-separated (agent.UNIT_PROPS)
#   UNITS  unit names, separated by spaces (the controller checks they are plain names)
#   GPUS   empty, or "SECONDS COMMAND...": nvidia-smi's query (agent.NVIDIA_SMI) and its timeout
#   TPU    empty, or 1 to count /dev/accelN
#   TENANCY empty, or "LEDGER_DIR UNIT_PREFIX OWN_ENTRY LISTEN ETC VAR" (host/layout.py) for the host's
#          ledger (every job's entry, its runs, end marker and exits, every provision unit's state) and with LISTEN 1 the
#          listening TCP sockets ("PORT INODE [lo]" lines, from ss or /proc/net/tcp and tcp6)
#   CLOCK  empty, 1 for the host's clock (date +%s.%N), or 2 for that and /proc/uptime (the
#          seconds since boot, as systemd's monotonic timestamps count them on a host that
#          has not been suspended)
#   APPS   empty, or "SECONDS COMMAND...": the GPUs' compute processes (hostcheck.APPS_QUERY),
#          run when the GPU query answered and a GPU has memory in use (its last column,
#          memory.used, is not 0: hostcheck.memory_in_use)
#   PORTS  empty, or " 2222 2223 ": the job's ports here: their listening sockets, the
#          processes holding them (find), and of those and of APPS' processes: comm, cgroup, and outside provision's units
#          their PROVISION_JOB/PROVISION_TASK (a container task's process)
#   DISK   empty, or paths (space-separated): free space of each one's file system (stat -f)
#   RESOLVE empty, or the host's cluster address: getent ahosts, and ip -o addr show
#   LOOK   empty, or paths (space-separated) only stat-ed, never hashed or read: the programs
#          tasks about to start run (ProbeRequest.programs)
#   KNOWN  "SYSTEMD_DIR INVOCATION_PREFIX" (layout.unit_known_paths): a unit is shown only
#          when its file or its running invocation is there
#   DROPINS "GLOB BASE..." (layout.DROPIN_DIRS, DROPIN_BASES): every BASE/GLOB/*.conf file,
#          the drop-ins systemd reads for provision's units (none are provision's: drift);
#          "GLOB" alone (no files asked, as for status): none read
#   HEALTH empty, or "SECONDS LIMIT FIELDS LEGACY AFTER KMSG" (health.words): the health read
#          (health.HEALTH_SH, as written there: the GPUs' health fields, the kernel's Xid
#          lines since the last look, DCGM's health watch)
#   LOGINS empty, or "V2 V2B V1" (host/logins.CGROUP_MOUNTS): each provision unit's sshd
#          processes, "UNIT TITLE" lines (a dev session's connections: host/logins.py)
#   PROGRESS empty, or paths (space-separated) whose modification time alone is read (stat, not
#          through a link): what shows a job's progress (ProbeRequest.progress)
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
tenancy=$6
clock=$7
apps=$8
ports=$9
disk=${10}
resolve=${11}
look=${12}
udir=${13%% *}
invoc=${13#* }
dglob=${14%% *}
dbases=
case ${14} in *" "*) dbases=${14#* } ;; esac
health=${15}
logins=${16}
progress=${17}
shift 17
nl="
"
gcode=""
gout=""
echo @probe 1
if [ -d /run/systemd/system ]; then echo @systemd; fi
if [ -n "$gpus" ]; then
    out=$(timeout $gpus 2>/dev/null </dev/null)
    gcode=$?
    gout=$out
    echo @gpus $gcode
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
# The listening TCP sockets as "PORT INODE [lo]" lines (ledger.listen_pairs), read once for the
# ledger and the port check. ss asks the kernel for listeners only (INODE 0: ss prints
# inodes only with -e, which also resolves every socket's cgroup by walking the cgroup tree,
# 70 ms on a host with many containers); /proc/net/tcp and tcp6 walk every bucket of the
# kernel's socket tables (about twice what ss costs), so they are read only where ss is
# missing (or too old for -H), or for the inodes when a job's port has a listener.
ldir=${tenancy%% *}
rest=${tenancy#* }
prefix=${rest%% *}
rest=${rest#* }
own=${rest%% *}
rest=${rest#* }
scan=${rest%% *}
rest=${rest#* }
edir=${rest%% *}
vdir=${rest#* }
listen=
if [ -n "$ports" ] || { [ -n "$tenancy" ] && [ "$scan" = 1 ]; }; then
    proc=1
    if out=$(ss -Hltn 2>/dev/null </dev/null); then
        proc=
        while read -r l; do
            la=
            for w in $l; do
                case $w in *:*) if [ -z "$la" ]; then la=$w; fi ;; esac
            done
            if [ -n "$la" ]; then
                # " lo": on a loopback address (ledger.local_only: the host's own service)
                case $la in 127.*|"[::1]:"*|"[::ffff:127."*) lo=" lo" ;; *) lo= ;; esac
                listen="$listen${la##*:} 0$lo$nl"
                case "$ports" in *" ${la##*:} "*) proc=1 ;; esac
            fi
        done <<EOF
$out
EOF
    fi
    if [ -n "$proc" ]; then
        listen=
        out=$(grep -h -- " 0A " /proc/net/tcp /proc/net/tcp6 2>/dev/null </dev/null)
        while read -r sl la ra st q t r u to ino rest; do
            case ${la%:*} in ??????7F|00000000000000000000000001000000|0000000000000000FFFF0000??????7F) lo=" lo" ;; *) lo= ;; esac
            if [ "$st" = 0A ]; then listen="$listen$((0x${la##*:})) $ino$lo$nl"; fi
        done <<EOF
$out
EOF
    fi
fi
if [ -n "$tenancy" ] && [ "$scan" = 1 ]; then
    echo @listen
    printf %s "$listen"
    echo @listen-end
fi
# A dev session's connections: its unit's sshd processes and their titles (comm first: a
# title is read only for sshd's own processes), each process once (host/logins.py: the
# system.slice under PID 1's own cgroup in each hierarchy, unified ones then name=systemd).
if [ -n "$logins" ]; then
    echo @logins
    v2a=${logins%% *}
    lr=${logins#* }
    v2b=${lr%% *}
    v1=${lr#* }
    bases=
    while IFS=: read -r cn cc cp; do
        cp=${cp%/init.scope}
        case $cn:$cc in
            0:) for m in $v2a $v2b; do if [ -d "$m$cp/system.slice" ]; then bases="$bases $m$cp/system.slice"; fi; done ;;
            *:name=systemd) if [ -d "$v1$cp/system.slice" ]; then bases="$bases $v1$cp/system.slice"; fi ;;
        esac
    done 2>/dev/null </proc/1/cgroup
    seen=" "
    set +f
    for d in $bases; do
        for f in $d/provision-*.service/cgroup.procs; do
            if [ -r "$f" ]; then
                u=${f%/cgroup.procs}
                u=${u##*/}
                while read -r pid; do
                    case $seen in *" $pid "*) continue ;; esac
                    seen="$seen$pid "
                    c=
                    read -r c 2>/dev/null </proc/$pid/comm
                    case $c in sshd|sshd-session)
                        t=$(head -c 512 /proc/$pid/cmdline 2>/dev/null | tr -d "[:cntrl:]")
                        echo "$u $t" ;;
                    esac
                done 2>/dev/null <"$f"
            fi
        done
    done
    set -f
    echo @logins-end
fi
if [ -n "$tenancy" ]; then
    others=
    set +f
    for f in $ldir/*.json; do
        if [ -f "$f" ]; then
            set -- "$@" "$f"
            if [ "$f" != "$own" ]; then
                others=1
                # Its runs and end marker: what the service's rounds tell a run's end from.
                j=${f##*/}
                j=${j%.json}
                if [ -f "$vdir/$j/runs.json" ]; then set -- "$@" "$vdir/$j/runs.json"; fi
                if [ -f "$edir/$j/lifecycle.json" ]; then set -- "$@" "$edir/$j/lifecycle.json"; fi
                for e in "$vdir/$j"/*.exits; do
                    if [ -f "$e" ]; then set -- "$@" "$e"; fi
                done
            fi
        fi
    done
    # The host's health record (health.py): placement keeps new work off what it quarantines.
    if [ -f "$ldir/.health.json" ]; then set -- "$@" "$ldir/.health.json"; fi
    # Other jobs units states only when other jobs have entries here (the common case of
    # one job per host shows nothing more), and never a unit twice.
    if [ -n "$others" ]; then
        for f in $prefix*.service; do
            case " $units " in
                *" ${f##*/} "*) ;;
                *) if [ -f "$f" ]; then units="$units ${f##*/}"; fi ;;
            esac
        done
    fi
    set -f
fi
# Checks: probe.py hands what these print to host/hostcheck.py's parsers, which the agent
# uses on what it reads itself.
# The clock also when other jobs have ledger entries: their ages are judged on this host's
# clock, the one they were written with.
if [ -n "$clock" ] || [ -n "$others" ]; then echo "@clock $(date +%s.%N)"; fi
if [ "$clock" = 2 ]; then
    up=
    read -r up rest </proc/uptime
    echo "@uptime $up"
fi
pids=""
busy=""
ifs=$IFS
IFS=$nl
for l in $gout; do
    case ${l##*, } in 0) ;; *) busy=1 ;; esac
done
IFS=$ifs
if [ -n "$apps" ] && [ "$gcode" = 0 ] && [ -n "$busy" ]; then
    out=$(timeout $apps 2>/dev/null </dev/null)
    echo @apps $?
    printf %s "$out"
    echo
    echo @apps-end
    ifs=$IFS
    IFS=$nl
    for l in $out; do
        p=${l#*, }
        p=${p%%,*}
        case $p in ""|*[!0-9]*) ;; *) case " $pids " in *" $p "*) ;; *) pids="$pids $p" ;; esac ;; esac
    done
    IFS=$ifs
fi
if [ -n "$ports" ]; then
    echo @sockets
    inodes=""
    while read -r port ino _; do
        case "$ports" in *" $port "*)
            echo "$port $ino"
            case $ino in 0|""|*[!0-9]*) ;; *) inodes="$inodes $ino" ;; esac ;;
        esac
    done <<EOF
$listen
EOF
    echo @fds
    if [ -n "$inodes" ]; then
        expr=""
        for i in $inodes; do
            if [ -n "$expr" ]; then expr="$expr -o"; fi
            expr="$expr -lname socket:?$i?"
        done
        dirs=""
        set +f
        for d in /proc/[0-9]*/fd; do dirs="$dirs $d"; done
        set -f
        out=$(find $dirs -mindepth 1 -maxdepth 1 "(" $expr ")" -printf "%h %l$nl" 2>/dev/null </dev/null)
        printf %s "$out"
        echo
        ifs=$IFS
        IFS=$nl
        for l in $out; do
            p=${l#/proc/}
            p=${p%%/*}
            case $p in ""|*[!0-9]*) ;; *) case " $pids " in *" $p "*) ;; *) pids="$pids $p" ;; esac ;; esac
        done
        IFS=$ifs
    fi
fi
if [ -n "$apps$ports" ]; then
    echo @procs
    for p in $pids; do
        if [ -d /proc/$p ]; then
            echo "@pid $p"
            c=""
            read -r c 2>/dev/null </proc/$p/comm
            echo "$c"
            cg=""
            if [ -r /proc/$p/cgroup ]; then
                while read -r l; do
                    echo "$l"
                    cg="$cg$l"
                done 2>/dev/null </proc/$p/cgroup
            fi
            case $cg in *"/provision-"*) ;; *)
                echo @env
                grep -a -o -E "PROVISION_(JOB|TASK)=[A-Za-z0-9._-]*" /proc/$p/environ 2>/dev/null </dev/null ;;
            esac
        fi
    done
    echo @procs-end
fi
if [ -n "$disk" ]; then
    echo @disk
    stat -f -c "%a %S %n" -- $disk 2>/dev/null </dev/null
    echo @disk-end
fi
if [ -n "$resolve" ]; then
    out=$(getent ahosts "$resolve" 2>/dev/null </dev/null)
    echo @resolve
    printf %s "$out"
    echo
    out=$(ip -o addr show 2>/dev/null </dev/null)
    echo @ip $?
    printf %s "$out"
    echo
    echo @resolve-end
fi
# The health read, as health.HEALTH_SH is written there (the agent runs the same text).
if [ -n "$health" ]; then
hsec=${health%% *}
r=${health#* }
hlim=${r%% *}
r=${r#* }
hfields=${r%% *}
r=${r#* }
hlegacy=${r%% *}
r=${r#* }
hafter=${r%% *}
hkmsg=${r#* }
hgok=0
if [ -n "$gpus" ] && [ "$gcode" = 0 ]; then hgok=1; fi
# The health read: host/health.HEALTH_SH, put in here when the script is loaded (io/probe.py).
@HEALTH_SH@
fi
if [ -n "$progress" ]; then
    echo @progress
    stat -c "%Y %n" -- $progress 2>/dev/null </dev/null
    echo @progress-end
fi
# Drop-ins: a base whose top directory is a link (/lib on a merged-/usr host) is skipped,
# as the agent does (hostlib.dropins): the same files again.
echo @dropins
set +f
for b in $dbases; do
    t=${b#/}
    t=/${t%%/*}
    if [ ! -h "$t" ]; then
        for f in $b/$dglob/*.conf; do
            if [ -e "$f" ] || [ -h "$f" ]; then echo "$f"; fi
        done
    fi
done
set -f
echo @stat
if [ $# -gt 0 ] || [ -n "$look" ]; then stat -c "%s %f %u %n" -- "$@" $look 2>/dev/null </dev/null; fi
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
# Only units whose file or running invocation is there (layout.unit_known_paths, KNOWN):
# systemd knows nothing of the others, and asking would make PID 1 look for their files.
# A unit whose run is live (its invocation link) is running: said here as the agent says
# it (agent.running_state), without systemctl, but for status (CLOCK 2), which shows how long.
shown=
for u in $units; do
    if [ "$clock" != 2 ] && [ -h "$invoc$u" ]; then
        echo "Id=$u"
        echo LoadState=loaded
        echo ActiveState=active
        echo SubState=running
        echo
    elif [ -e "$udir$u" ] || [ -h "$udir$u" ] || [ -h "$invoc$u" ]; then
        shown="$shown $u"
    fi
done
if [ -n "$shown" ]; then
    systemctl show "--property=$props" -- $shown </dev/null
fi
echo @end
