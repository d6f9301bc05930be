#!/bin/sh
# Runs once at image build time, inside the debootstrapped tree (chroot), after the files
# under rootfs/ were copied in. Part of the image recipe: editing it rebuilds the image.
set -eu
export PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C

# Each container generates its own SSH host key at first boot
# (provision-ssh-host-key.service); none may be baked into the image.
rm -f /etc/ssh/ssh_host_*

# An empty machine-id makes systemd generate a fresh one per container at boot, without
# the "first boot" preset pass that a missing file would trigger.
: > /etc/machine-id
rm -f /var/lib/dbus/machine-id
ln -s /etc/machine-id /var/lib/dbus/machine-id

chmod 0755 /usr/bin/nvidia-smi /usr/bin/dcgmi /usr/lib/provision-sandbox/nvidia-smi-standin \
    /usr/lib/provision-sandbox/dcgmi-standin /usr/lib/provision-sandbox/infiniband \
    /usr/lib/provision-sandbox/nccl-tests/all_reduce_perf /usr/lib/provision-sandbox/nccl-tests/mpirun
chmod 0644 /usr/lib/provision-sandbox/nvidia-smi-fabric
chmod 0644 /etc/ssh/sshd_config.d/provision-sandbox.conf \
    /etc/systemd/system/provision-ssh-host-key.service \
    /etc/systemd/journald.conf.d/provision-sandbox.conf \
    /usr/lib/python3/dist-packages/provision-sandbox-frameworks.pth \
    /usr/lib/python3/dist-packages/provision_sandbox_frameworks.py

systemctl set-default multi-user.target
systemctl enable ssh.service provision-ssh-host-key.service

# Units that wait for hardware, ttys or kernel interfaces a container does not have, or
# timers that would wake up apt/fstrim during tests: masked so boot is fast and "running".
systemctl mask \
    getty.target console-getty.service getty@tty1.service serial-getty@console.service \
    systemd-udevd.service systemd-udevd-control.socket systemd-udevd-kernel.socket \
    systemd-udev-trigger.service systemd-udev-settle.service \
    systemd-modules-load.service kmod-static-nodes.service systemd-hwdb-update.service \
    systemd-remount-fs.service systemd-pstore.service systemd-firstboot.service \
    systemd-binfmt.service proc-sys-fs-binfmt_misc.automount \
    systemd-journald-audit.socket \
    sys-kernel-config.mount sys-kernel-debug.mount sys-kernel-tracing.mount \
    dev-hugepages.mount sys-fs-fuse-connections.mount \
    systemd-networkd-wait-online.service \
    e2scrub_reap.service e2scrub_all.timer fstrim.timer \
    apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer

# Where the sandbox writes per-host settings (gpus) and mounts framework layers.
mkdir -p /etc/provision-sandbox /opt/provision-sandbox/frameworks /root/.ssh
chmod 0700 /root/.ssh

# Smaller image: downloaded .debs are not needed on the hosts.
apt-get clean
rm -rf /var/cache/apt/*.bin /var/log/*.log /tmp/* /var/tmp/*
