// The job of `tmem bench ramp` (seed 001: zswap's SPECjbb2005 heap ramp).
//
// A fixed mix of business-like operations over a live heap that grows in
// steps. Step by step it grows its live set of orders (objects holding
// strings, numbers and a line-item array) to the step's size, then for a
// fixed time runs the mix: look up an order and total its lines (reads),
// replace an order by a new one (object churn; the live size stays),
// insert then remove an order (map churn), and sort the lines of an
// order. It prints one line per step when the timed part ends:
//
//   step LIVE_MIB ops OPS secs SECONDS checksum C
//
// and flushes, so the bench sees each step as it ends; "begin LIVE_MIB"
// when the timed part of a step starts. At the end it checks every order
// against the sum it recorded when it made it, and prints "verified N" (or
// "CORRUPT N" and exits 1): a page swapped back wrong would show. Run with
// `java Ramp.java STEP_MIB,... SECONDS SEED` (JDK 11 or later runs a
// source file directly).

import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.SplittableRandom;

public class Ramp {
    static final String[] WORDS = {
        "acme", "order", "customer", "widget", "gadget", "supply", "north", "south", "east", "west",
        "district", "warehouse", "payment", "delivery", "stock", "item", "invoice", "credit", "ltd", "inc",
    };

    static final class Order {
        final long id;
        final String customer;
        final String address;
        final long[] lines;
        /** total() when it was made. */
        final long sum;

        Order(long id, SplittableRandom r) {
            this.id = id;
            this.customer = words(r, 3) + " " + r.nextInt(1_000_000);
            this.address = r.nextInt(10_000) + " " + words(r, 2) + " street, " + words(r, 1);
            this.lines = new long[8 + r.nextInt(24)];
            for (int i = 0; i < lines.length; i++) {
                // item id, quantity and price packed: realistic, compressible numbers
                lines[i] = ((long) r.nextInt(100_000) << 32) | ((long) r.nextInt(50) << 20) | r.nextInt(100_000);
            }
            this.sum = total();
        }

        long total() {
            long t = customer.length() + address.length();
            for (long l : lines) {
                t += ((l >>> 20) & 0xfff) * (l & 0xfffff);
            }
            return t;
        }
    }

    static String words(SplittableRandom r, int n) {
        StringBuilder b = new StringBuilder();
        for (int i = 0; i < n; i++) {
            if (i > 0) b.append(' ');
            b.append(WORDS[r.nextInt(WORDS.length)]);
        }
        return b.toString();
    }

    /** Bytes one order takes on the heap, about (measured by growth, not assumed). */
    static final long ORDER_BYTES = 400;

    public static void main(String[] args) {
        if (args.length != 3) {
            System.err.println("usage: java Ramp.java STEP_MIB,... SECONDS SEED");
            System.exit(2);
        }
        long[] steps = Arrays.stream(args[0].split(",")).mapToLong(Long::parseLong).toArray();
        double secs = Double.parseDouble(args[1]);
        SplittableRandom r = new SplittableRandom(Long.parseLong(args[2]));
        HashMap<Long, Order> orders = new HashMap<>();
        ArrayList<Long> ids = new ArrayList<>();
        long nextId = 0;
        long checksum = 0;
        for (long mib : steps) {
            long want = mib * (1L << 20) / ORDER_BYTES;
            while (ids.size() < want) {
                long id = nextId++;
                orders.put(id, new Order(id, r));
                ids.add(id);
            }
            System.out.printf("begin %d%n", mib);
            System.out.flush();
            long ops = 0;
            long start = System.nanoTime();
            long end = start + (long) (secs * 1e9);
            while (true) {
                for (int i = 0; i < 64; i++) {
                    int op = r.nextInt(100);
                    Long id = ids.get(r.nextInt(ids.size()));
                    if (op < 60) {
                        checksum += orders.get(id).total();
                    } else if (op < 85) {
                        orders.put(id, new Order(id, r));
                    } else if (op < 95) {
                        long tmp = nextId++;
                        orders.put(tmp, new Order(tmp, r));
                        checksum += orders.remove(tmp).lines.length;
                    } else {
                        long[] l = orders.get(id).lines.clone();
                        Arrays.sort(l);
                        checksum += l[0];
                    }
                }
                ops += 64;
                if (System.nanoTime() >= end) break;
            }
            double took = (System.nanoTime() - start) / 1e9;
            System.out.printf("step %d ops %d secs %.3f checksum %d%n", mib, ops, took, checksum & 0xffff);
            System.out.flush();
        }
        long bad = 0;
        for (Order o : orders.values()) {
            if (o.total() != o.sum) bad++;
        }
        if (bad > 0) {
            System.out.printf("CORRUPT %d%n", bad);
            System.exit(1);
        }
        System.out.printf("verified %d%n", orders.size());
    }
}
