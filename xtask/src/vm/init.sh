#!/bin/busybox sh
# The initramfs's init (cargo xtask vm): loads the modules that mounting
# the host's root takes, mounts it read-only over virtio-9p under a tmpfs
# overlay (so the VM may write anywhere and the host sees none of it), and
# switches to it to run stage2. Nothing of the host's is run before that:
# busybox is static and brought along.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
fail() { echo "xtask vm init: $*"; cat /proc/uptime; reboot -f; sleep 10; }
for m in $(cat /modules/order); do
    insmod "/modules/$m.ko" || fail "insmod $m failed"
done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 hostroot /lower ||
    fail "cannot mount the host's root over 9p"
mount -t tmpfs -o mode=755 tmpfs /upper
mkdir -p /upper/upper /upper/work
mount -t overlay -o lowerdir=/lower,upperdir=/upper/upper,workdir=/upper/work overlay /newroot ||
    fail "cannot mount the overlay"
mkdir -p /newroot/.xtask-vm
cp /bin/busybox /stage2 /newroot/.xtask-vm/
umount /proc /sys
umount /dev 2>/dev/null
exec switch_root /newroot /.xtask-vm/stage2
