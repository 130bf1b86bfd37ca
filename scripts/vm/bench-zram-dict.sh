# zram's density with zstd at level 9, without and with a dictionary
# (`algorithm_params`, Linux 6.12+), on pages `tmem corpus export` wrote,
# sourced by scripts/vm/init.sh in a Debian 13 guest:
#   tmem corpus export A.tcorp B.tcorp ... --each 40M --out target/pages.raw --dictionary target/pages.dict
#   VM_BENCH=scripts/vm/bench-zram-dict.sh VM_FILES="target/pages.raw target/pages.dict" \
#       VM_MEMORY=1536 VM_KERNELS=trixie scripts/vm-test.sh
# The same pages and dictionary on tmem's side:
#   cargo run --release -p tmem-core --example group_density -- --dict target/pages.dict --each 10240 A.tcorp B.tcorp ...
# mm_stat: orig_data_size compr_data_size mem_used_total ...; the ratio is
# orig_data_size / mem_used_total (the allocator's pages, metadata aside).
modprobe zram num_devices=0 || exit 1
id=$(cat /sys/class/zram-control/hot_add)
z=/sys/block/zram$id
echo "pages: $(($(stat -c %s /data/pages.raw) / 4096)), dictionary: $(stat -c %s /data/pages.dict) bytes"
for params in "level=9" "level=9 dict=/data/pages.dict"; do
    echo zstd > "$z/comp_algorithm" || exit 1
    echo "algo=zstd $params" > "$z/algorithm_params" || exit 1
    echo 1G > "$z/disksize" || exit 1
    dd if=/data/pages.raw of="/dev/zram$id" bs=1M conv=fsync 2> /dev/null || exit 1
    set -- $(cat "$z/mm_stat")
    echo "zram zstd $params: orig_data_size $1 compr_data_size $2 mem_used_total $3 same_pages $6 huge_pages $8: ratio $(awk "BEGIN {printf \"%.3f\", $1 / $3}") (compressed bytes alone $(awk "BEGIN {printf \"%.3f\", $1 / $2}"))"
    echo 1 > "$z/reset"
done
echo "$id" > /sys/class/zram-control/hot_remove
