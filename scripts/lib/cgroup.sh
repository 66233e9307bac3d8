# Sourced by the scripts that run llama.cpp and leanstream under one memory limit: this process's
# cgroup v1 memory group (`$parent`, under which the limited groups are made; exits when there is
# no writable one) and `cold FILE`, which drops FILE's pages from the page cache.

mount="$(awk '{ for (i = 7; i < NF; i++) if ($i == "-") { if ($(i + 1) == "cgroup" && $NF ~ /(^|,)memory(,|$)/) print $5; break } }' /proc/self/mountinfo | head -1)"
own="$(awk -F: '$2 ~ /(^|,)memory(,|$)/ { print $3; exit }' /proc/self/cgroup)"
parent="$mount$own"
[[ -n "$mount" && -w "$parent" ]] || { echo "no writable cgroup v1 memory controller" >&2; exit 1; }

# cold FILE: drop FILE's pages from the page cache.
cold() {
    python3 -c 'import os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)' "$1"
}
