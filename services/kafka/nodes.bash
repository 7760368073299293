# services/kafka/nodes.bash: the Kafka nodes that services/up runs, for
# services/up, services/down and services/kafka-node (sourced, not run).
#
# Two shapes, kept apart so that switching between them never mixes data:
#   1 broker   one KRaft node (broker and controller in one process),
#              in .services/kafka/
#   3 brokers  three such nodes, ids 1, 2 and 3, a three-voter controller
#              quorum, in .services/kafka-cluster/node-<id>/
# Both run the jars in .services/kafka/lib. Each node's directory holds its
# server.properties, data/, broker.pid, broker.log and java.opts.
#
# The sourcing script sets STATE (its .services directory) and SERVICES_SRC
# (its services directory) and defines say, warn and die.

KAFKA_SRC=$SERVICES_SRC/kafka
KAFKA_DIR=$STATE/kafka
KAFKA_LIB=$KAFKA_DIR/lib
CLUSTER_DIR=$STATE/kafka-cluster
CLUSTER_BROKERS=3
# The shape services/up last started Kafka in (1 or 3): services/kafka-node
# acts on that one.
SHAPE_FILE=$STATE/kafka.brokers
DEFAULT_JAVA_OPTS=(-Xms256m -Xmx512m)

# alive PID: the process exists and is not a zombie waiting to be reaped.
alive() {
    local st
    kill -0 "$1" 2>/dev/null || return 1
    st=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
    [[ $st != Z* ]]
}

# tcp_open HOST PORT: true if something accepts a TCP connection there (2 s cap).
tcp_open() {
    # shellcheck disable=SC2016  # expanded by the inner bash
    timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2" 2>/dev/null
}

show_log() { # show_log FILE [LINES]
    local f=$1 n=${2:-30}
    if [[ -s $f ]]; then
        printf -- '----- last %s lines of %s -----\n' "$n" "$f" >&2
        tail -n "$n" -- "$f" >&2 || true
        printf -- '-----\n' >&2
    else
        warn "($f is empty or missing)"
    fi
}

# node_paths BROKERS ID: set NODE_DIR, NODE_PROPS, NODE_PID, NODE_LOG,
# NODE_DATA and NODE_OPTS for node ID of the shape with BROKERS brokers.
node_paths() {
    if (($1 == 1)); then NODE_DIR=$KAFKA_DIR; else NODE_DIR=$CLUSTER_DIR/node-$2; fi
    NODE_PROPS=$NODE_DIR/server.properties
    NODE_PID=$NODE_DIR/broker.pid
    NODE_LOG=$NODE_DIR/broker.log
    NODE_DATA=$NODE_DIR/data
    NODE_OPTS=$NODE_DIR/java.opts
}

# is_kafka_of PID PROPS: PID is alive and is the broker started with PROPS.
is_kafka_of() {
    local pid=$1 args
    [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" || return 1
    args=$(ps -ww -o args= -p "$pid" 2>/dev/null) || return 1
    [[ $args == *" kafka.Kafka $2" ]]
}

# find_kafka_pid_of PROPS PIDFILE: print the pid of the broker started with
# PROPS (the pid file first, then a scan for one whose pid file got lost).
find_kafka_pid_of() {
    local props=$1 pidfile=$2 pid line
    if [[ -f $pidfile ]]; then
        pid=$(<"$pidfile")
        if is_kafka_of "$pid" "$props"; then printf '%s\n' "$pid"; return 0; fi
    fi
    while read -r pid line; do
        if [[ $line == *" kafka.Kafka $props" ]] && is_kafka_of "$pid" "$props"; then
            printf '%s\n' "$pid"
            return 0
        fi
    done < <(ps -ww -eo pid=,args= 2>/dev/null || true)
    return 1
}

# node_pid BROKERS ID: print the pid of that node if it runs.
node_pid() {
    node_paths "$1" "$2"
    find_kafka_pid_of "$NODE_PROPS" "$NODE_PID"
}

# props_port PROPS LISTENER: the port of LISTENER (PLAINTEXT, CONTROLLER,
# SASL_SSL) in the listeners= line of a generated server.properties.
props_port() {
    local line
    line=$(grep -m 1 '^listeners=' -- "$1" 2>/dev/null) || return 1
    [[ $line =~ (^|[=,])$2://[^,:]*:([0-9]+) ]] || return 1
    printf '%s\n' "${BASH_REMATCH[2]}"
}

# broker_count PORT: how many brokers the metadata of the broker at
# 127.0.0.1:PORT lists. A Metadata v4 request for no topics over bash's
# /dev/tcp (the broker's jars do not include Kafka's admin tools, and CI has
# a Java runtime without a compiler): the reply starts with its size, the
# correlation id, the throttle time, then the number of brokers, 4 bytes each.
# Fails when nothing answers (or not like a broker).
broker_count() {
    local hex
    # shellcheck disable=SC2016  # expanded by the inner bash
    hex=$(timeout 5 bash -c '
        exec 3<>"/dev/tcp/127.0.0.1/$0" || exit 1
        # size 27; api key 3 (Metadata), version 4, correlation id 1,
        # client id "outbox-probe", topics: an empty array, no auto-creation
        printf "\x00\x00\x00\x1b\x00\x03\x00\x04\x00\x00\x00\x01\x00\x0coutbox-probe\x00\x00\x00\x00\x00" >&3
        head -c 16 <&3 | od -An -v -tx1' "$1" 2>/dev/null) || return 1
    # shellcheck disable=SC2086  # split the hex bytes into words on purpose
    set -- $hex
    (($# == 16)) && [[ $5$6$7$8 == 00000001 ]] || return 1
    printf '%d\n' "$((16#${13}${14}${15}${16}))"
}

find_java() {
    if [[ -n ${JAVA_HOME:-} && -x $JAVA_HOME/bin/java ]]; then
        JAVA=$JAVA_HOME/bin/java
    else
        JAVA=$(command -v java 2>/dev/null) || die "java not found (install a JDK >= 17 or set JAVA_HOME)"
    fi
}

# launch_node DIR PROPS PIDFILE LOG OPTSFILE JAVA_OPT...: start kafka.Kafka
# with PROPS, detached from this terminal, and set LAUNCHED_PID. The pid file
# is written by the process itself right before it becomes java; the previous
# log becomes LOG.1; the JVM options are kept in OPTSFILE so that
# services/kafka-node can start the node again the same way. Needs JAVA.
launch_node() {
    local dir=$1 props=$2 pidfile=$3 log=$4 optsfile=$5
    shift 5
    printf '%s\n' "$*" >"$optsfile"
    [[ -f $log ]] && mv -f -- "$log" "$log.1"
    rm -f -- "$pidfile"
    (
        cd -- "$dir"
        # shellcheck disable=SC2016  # expanded by the inner bash
        exec setsid nohup bash -c 'printf "%s\n" "$$" >"$0"; exec "$@"' "$pidfile" \
            "$JAVA" "$@" -Djava.awt.headless=true -XX:+ExitOnOutOfMemoryError \
            -Dlog4j2.configurationFile="$KAFKA_SRC/log4j2.properties" -Dlog4j2.shutdownHookEnabled=false \
            -cp "$KAFKA_LIB/*" kafka.Kafka "$props"
    ) </dev/null >>"$log" 2>&1 9>&- &
    local deadline=$((SECONDS + 10))
    until [[ -s $pidfile ]]; do
        ((SECONDS < deadline)) || { show_log "$log"; die "Kafka did not start (no pid file $pidfile after 10 s)"; }
        sleep 0.1
    done
    LAUNCHED_PID=$(<"$pidfile")
}

# node_ready LOG PROPS BROKERS: the node logged that it started (not looked
# at when LOG is empty: a node that was already running), answers on its
# client listener (and its SASL_SSL one, if it has one), and its metadata
# lists at least BROKERS brokers: the controller quorum stands and has that
# many brokers registered.
node_ready() {
    local log=$1 props=$2 brokers=$3 port sasl n
    [[ -z $log ]] || grep -qF 'Kafka Server started' -- "$log" 2>/dev/null || return 1
    port=$(props_port "$props" PLAINTEXT) || return 1
    tcp_open 127.0.0.1 "$port" || return 1
    if sasl=$(props_port "$props" SASL_SSL); then tcp_open 127.0.0.1 "$sasl" || return 1; fi
    n=$(broker_count "$port") && ((n >= brokers))
}

# any_alive PID...: whether one of them is alive; sets STILL_ALIVE to those.
any_alive() {
    local pid
    STILL_ALIVE=()
    for pid; do alive "$pid" && STILL_ALIVE+=("$pid"); done
    ((${#STILL_ALIVE[@]}))
}

# stop_pids WHAT PID...: SIGTERM to each at once, then wait up to 30 s; any
# still running then gets SIGKILL (and 10 s more). Fails if one still runs.
# A clean stop writes .kafka_cleanshutdown, so the next start needs no log
# recovery.
stop_pids() {
    local what=$1 deadline=$((SECONDS + 30))
    shift
    kill -TERM "$@" 2>/dev/null || true
    while any_alive "$@" && ((SECONDS < deadline)); do sleep 0.1; done
    if any_alive "$@"; then
        warn "$what (pid ${STILL_ALIVE[*]}) did not stop within 30 s; sending SIGKILL"
        kill -KILL "${STILL_ALIVE[@]}" 2>/dev/null || true
        deadline=$((SECONDS + 10))
        while any_alive "$@" && ((SECONDS < deadline)); do sleep 0.1; done
    fi
    ! any_alive "$@"
}
