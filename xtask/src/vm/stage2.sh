#!/.xtask-vm/busybox sh
# Run on the VM's root, the host's or an arm64 one (cargo xtask vm): mounts
# what a running system has, the shared directories and the run directory,
# then runs the command with bash as root. Its output and status go to files
# in the run directory, which the host reads as they grow; the VM then
# powers off.
# busybox is called by its path: the host's tools may not all be there.
bb=/.xtask-vm/busybox
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
# An arm64 root, unpacked packages only, may lack the mount points.
$bb mkdir -p /proc /sys /dev /run /tmp /root
$bb chmod 1777 /tmp
$bb mount -t proc proc /proc
$bb mount -t sysfs sysfs /sys
$bb mount -t devtmpfs devtmpfs /dev
$bb mkdir -p /dev/pts /dev/shm
$bb mount -t devpts -o gid=5,mode=620,ptmxmode=000 devpts /dev/pts
$bb mount -t tmpfs -o mode=1777 tmpfs /dev/shm
$bb mount -t tmpfs -o mode=755 tmpfs /run
$bb mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup 2>/dev/null || $bb mount -t cgroup2 cgroup2 /sys/fs/cgroup
$bb mount -t debugfs debugfs /sys/kernel/debug
$bb mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
$bb mount -t bpf -o mode=700 bpf /sys/fs/bpf
$bb mount -t securityfs securityfs /sys/kernel/security 2>/dev/null
$bb ip link set lo up
$bb hostname vm
set -- $($bb cat /proc/cmdline)
for a; do case "$a" in xtask.vm_run=*) run=${a#xtask.vm_run=} ;; esac; done
# The run directory is mounted here first, its files read, and bound at
# its own path only after the shares: one of them (target/) may hold it,
# and the root may not (an arm64 root is not this machine's).
runmount=/.xtask-vm/run
$bb mkdir -p "$runmount"
$bb mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 vmrun "$runmount"
moddir=$($bb cat "$runmount/moddir")
cwd=$($bb cat "$runmount/cwd")
i=0
while [ -e "$runmount/share.$i" ]; do
    read -r mode dir <"$runmount/share.$i"
    $bb mkdir -p "$dir"
    $bb mount -t 9p -o "trans=virtio,version=9p2000.L,msize=262144,$mode" "share$i" "$dir"
    i=$((i + 1))
done
$bb mkdir -p "$run"
$bb mount --bind "$runmount" "$run"
kver=$($bb uname -r)
if [ -d "$moddir" ]; then
    $bb mkdir -p "/lib/modules/$kver"
    $bb mount --bind "$moddir" "/lib/modules/$kver"
fi
$bb cut -d' ' -f1 /proc/uptime >"$run/booted"
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 TERM=dumb
export XTASK_VM=1 XTASK_VM_RUN_DIR="$run"
cd "$cwd" 2>/dev/null || cd /
/bin/bash "$run/command" </dev/null >>"$run/stdout" 2>>"$run/stderr"
echo $? >"$run/rc.tmp"
$bb cut -d' ' -f1 /proc/uptime >"$run/ended"
$bb dmesg >"$run/dmesg" 2>&1
$bb mv "$run/rc.tmp" "$run/rc"
$bb sync
$bb umount "$run" 2>/dev/null
$bb umount "$runmount" 2>/dev/null
$bb reboot -f
