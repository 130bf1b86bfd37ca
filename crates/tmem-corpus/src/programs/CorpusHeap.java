// tmem-corpus: build a realistic Java heap, then print "ready" and sleep until
// killed. Usage: java CorpusHeap TARGET_ANON_BYTES
//
// Models an in-memory order service: HashMaps of customers and products,
// ArrayLists of orders with boxed numbers, strings, enums, byte[] payloads,
// an inverted index, and some caches. Pseudo-random with a fixed seed.
import java.io.BufferedReader;
import java.io.FileReader;
import java.nio.charset.StandardCharsets;
import java.util.*;

public final class CorpusHeap {
    enum Status { NEW, PAID, SHIPPED, DELIVERED, RETURNED, CANCELLED }

    static final class Address {
        final String street, city, zip, country;
        Address(String street, String city, String zip, String country) {
            this.street = street; this.city = city; this.zip = zip; this.country = country;
        }
    }

    static final class Customer {
        final long id;
        final String name, email;
        final Integer age;
        final Double balance;
        final Address address;
        final List<String> tags = new ArrayList<>();
        final Map<String, Object> attributes = new HashMap<>();
        Customer(long id, String name, String email, Integer age, Double balance, Address address) {
            this.id = id; this.name = name; this.email = email; this.age = age;
            this.balance = balance; this.address = address;
        }
    }

    static final class Product {
        final String sku, title, description;
        final Double price;
        final Integer stock;
        Product(String sku, String title, String description, Double price, Integer stock) {
            this.sku = sku; this.title = title; this.description = description;
            this.price = price; this.stock = stock;
        }
    }

    static final class LineItem {
        final Product product;
        final Integer quantity;
        final Double unitPrice;
        LineItem(Product product, Integer quantity, Double unitPrice) {
            this.product = product; this.quantity = quantity; this.unitPrice = unitPrice;
        }
    }

    static final class Order {
        final Long id;
        final Customer customer;
        final List<LineItem> items = new ArrayList<>();
        Status status;
        final long createdMillis;
        String note;
        byte[] payload;
        Order(Long id, Customer customer, long createdMillis) {
            this.id = id; this.customer = customer; this.createdMillis = createdMillis;
        }
    }

    // Static roots so everything stays reachable while we sleep.
    static final Map<Long, Customer> CUSTOMERS = new HashMap<>();
    static final Map<String, Customer> BY_EMAIL = new HashMap<>();
    static final Map<String, Product> PRODUCTS = new HashMap<>();
    static final List<Order> ORDERS = new ArrayList<>();
    static final Map<String, List<Long>> INDEX = new HashMap<>();
    static final Map<String, Integer> COUNTERS = new TreeMap<>();
    static final List<String> LOG = new ArrayList<>();
    static final List<byte[]> BLOBS = new ArrayList<>();
    static final LinkedHashMap<String, String> CACHE = new LinkedHashMap<>(16, 0.75f, true);

    static final String[] SYL = {"ka", "lo", "mi", "ne", "to", "ra", "shi", "en", "dor", "al",
        "ve", "qu", "is", "tor", "an", "el", "ri", "os", "um", "ba", "zen", "ph"};
    static final String[] COUNTRIES = {"DE", "US", "FR", "JP", "BR", "IN", "GB", "NL", "SE", "CA"};
    static final String[] DOMAINS = {"example.com", "mail.test", "corp.invalid", "shop.example.org"};
    static String[] words;
    static final Random R = new Random(0x7E3EL);

    static long rssAnon() throws Exception {
        try (BufferedReader r = new BufferedReader(new FileReader("/proc/self/status"))) {
            String line;
            while ((line = r.readLine()) != null) {
                if (line.startsWith("RssAnon:")) {
                    return Long.parseLong(line.replaceAll("[^0-9]", "")) * 1024L;
                }
            }
        }
        return 0;
    }

    static String word() {
        // Zipf-like: low indices are much more frequent.
        int i = R.nextDouble() < 0.7
            ? (int) Math.min(words.length - 1, Math.floor(Math.pow(R.nextDouble(), 3) * words.length))
            : R.nextInt(words.length);
        return words[i];
    }

    static String cap(String s) {
        return Character.toUpperCase(s.charAt(0)) + s.substring(1);
    }

    static String sentence(int n) {
        StringBuilder sb = new StringBuilder();
        for (int i = 0; i < n; i++) {
            if (i > 0) sb.append(' ');
            sb.append(i == 0 ? cap(word()) : word());
        }
        return sb.append('.').toString();
    }

    public static void main(String[] args) throws Exception {
        long target = Long.parseLong(args[0]);
        Set<String> ws = new TreeSet<>();
        while (ws.size() < 5000) {
            StringBuilder sb = new StringBuilder();
            int n = 1 + R.nextInt(4);
            for (int i = 0; i < n; i++) sb.append(SYL[R.nextInt(SYL.length)]);
            ws.add(sb.toString());
        }
        words = ws.toArray(new String[0]);
        for (int i = 0; i < 20000; i++) {
            String sku = String.format("SKU-%06d-%s", i, COUNTRIES[i % COUNTRIES.length]);
            PRODUCTS.put(sku, new Product(sku, cap(word()) + " " + cap(word()), sentence(5 + R.nextInt(20)),
                Math.round(R.nextDouble() * 50000) / 100.0, R.nextInt(1000)));
        }
        String[] skus = PRODUCTS.keySet().toArray(new String[0]);
        long nextId = 0;
        long t0 = 1714521600000L;
        // Grow until the *live* heap reaches the target: the used heap includes
        // garbage, so confirm with a full GC, and use the live bytes per batch
        // seen so far to skip GCs until the target is likely to be reached.
        Runtime rt = Runtime.getRuntime();
        long batches = 0, skip = 0;
        while (true) {
            if (skip > 0) {
                skip--;
            } else if (rt.totalMemory() - rt.freeMemory() >= target) {
                System.gc();
                long live = rt.totalMemory() - rt.freeMemory();
                if (live >= target) break;
                skip = (long) ((target - live) / Math.max(1.0, (double) live / batches) * 0.8);
            }
            batches++;
            for (int k = 0; k < 2000; k++, nextId++) {
                String first = cap(word()), last = cap(word());
                String email = (first + "." + last + nextId).toLowerCase() + "@" + DOMAINS[R.nextInt(DOMAINS.length)];
                Address a = new Address((1 + R.nextInt(9999)) + " " + cap(word()) + " Street", cap(word()),
                    String.format("%05d", R.nextInt(100000)), COUNTRIES[R.nextInt(COUNTRIES.length)]);
                Customer c = new Customer(nextId, first + " " + last, email, 18 + R.nextInt(70),
                    Math.round(R.nextGaussian() * 100000) / 100.0, a);
                for (int t = R.nextInt(5); t > 0; t--) c.tags.add(word());
                c.attributes.put("newsletter", R.nextBoolean());
                c.attributes.put("visits", R.nextInt(500));
                c.attributes.put("lastLogin", t0 + (long) (R.nextDouble() * 3e10));
                if (R.nextDouble() < 0.3) c.attributes.put("referrer", "https://" + DOMAINS[R.nextInt(DOMAINS.length)] + "/" + word());
                CUSTOMERS.put(c.id, c);
                BY_EMAIL.put(email, c);
                for (int o = R.nextInt(4); o > 0; o--) {
                    Order ord = new Order(nextId * 8 + o, c, t0 + (long) (R.nextDouble() * 3e10));
                    for (int li = 1 + R.nextInt(5); li > 0; li--) {
                        Product p = PRODUCTS.get(skus[R.nextInt(skus.length)]);
                        ord.items.add(new LineItem(p, 1 + R.nextInt(9), p.price));
                    }
                    ord.status = Status.values()[R.nextInt(Status.values().length)];
                    if (R.nextDouble() < 0.4) ord.note = sentence(3 + R.nextInt(12));
                    if (R.nextDouble() < 0.25) {
                        // Serialized protocol message: mostly text with binary framing.
                        byte[] text = ("{\"order\":" + ord.id + ",\"customer\":\"" + email + "\",\"items\":"
                            + ord.items.size() + ",\"status\":\"" + ord.status + "\"}").getBytes(StandardCharsets.UTF_8);
                        byte[] p = new byte[text.length + 16 + R.nextInt(64)];
                        System.arraycopy(text, 0, p, 16, text.length);
                        for (int b = 0; b < 8; b++) p[b] = (byte) (ord.id >>> (8 * b));
                        ord.payload = p;
                    }
                    ORDERS.add(ord);
                }
                for (String w : sentence(4 + R.nextInt(10)).toLowerCase().split(" ")) {
                    INDEX.computeIfAbsent(w.replace(".", ""), x -> new ArrayList<>()).add(nextId);
                }
                COUNTERS.merge(a.country + "/" + c.age / 10, 1, Integer::sum);
                if (R.nextDouble() < 0.5) {
                    LOG.add(String.format("%tFT%<tT.%<tLZ INFO [http-nio-8080-exec-%d] c.e.OrderService - customer=%d %s",
                        new Date(t0 + (long) (R.nextDouble() * 3e10)), 1 + R.nextInt(32), nextId, sentence(2 + R.nextInt(8))));
                }
                if (R.nextDouble() < 0.03) {
                    byte[] b = new byte[64 + R.nextInt(2048)];
                    if (R.nextBoolean()) R.nextBytes(b);
                    else for (int i = 0; i < b.length; i++) b[i] = (byte) (i % 37 < 30 ? 'a' + i % 26 : 0);
                    BLOBS.add(b);
                }
                CACHE.put("session:" + Long.toHexString(R.nextLong()), email);
            }
        }
        System.out.println("ready " + nextId + " " + (rt.totalMemory() - rt.freeMemory()) + " " + rssAnon());
        System.out.flush();
        Thread.sleep(Long.MAX_VALUE);
    }
}
