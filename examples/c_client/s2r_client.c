/*
 * s2r_client: a minimal C client for `sim2real serve` (protocol: README.md, "Wire protocol").
 *
 * Plain POSIX sockets, no dependencies; what a PLC gateway or robot firmware
 * would do each control period: frame the observation, send it, wait for the
 * reply, check it, apply the action. HMAC-SHA256 is included (a small
 * SHA-256), so it works against a server started with --key-file.
 *
 * Protocol version 2: the key file's bytes (trailing whitespace stripped, not
 * hex-decoded, >= 32 bytes) are the pre-shared key PSK; requests are signed with
 * HMAC-SHA256(PSK, "S2RP v2 request") and replies verified with
 * HMAC-SHA256(PSK, "S2RP v2 reply"), so a reply can never pass as a request.
 * seq is the wall clock in µs (a keyed server requires it within its clock window).
 *
 *   cc -O2 -Wall -Wextra -std=c99 -o s2r_client s2r_client.c
 *   ./s2r_client [-k KEYFILE] [-l LEGACY_CSV] [-H NAMES_SHA256] [-m] [-e] HOST PORT OBS0 OBS1 ...
 *
 * -m: this step's observation is missing (a sensor dropout): the request carries flag OBS_MISSING (0x4) and NaN
 * in every observation slot (the OBS arguments give only their count); the server's shield dead-reckons. The
 * reply then carries BLIND (0x1000) and, once blind longer than the shield's blind horizon (the contract reply's
 * last field, printed as blind_horizon=), BLIND_PAST_HORIZON (0x2000): the guarantee has run out, stop the plant.
 *
 * -e: after the reply, ask what an adaptive policy now believes about this plant (an estimate request, type 7):
 * the domain parameters it infers from this plant's history, in the order of the contract's
 * plant_estimate.parameters. Printed as a second line
 *   estimate steps=S n=N values=V0 V1 ... bits=H0 H1 ...
 * (steps: the steps this plant's policy state has seen; n = 0 when the policy estimates nothing).
 *
 * The bundle it was built for: compile with -DS2R_NAMES_SHA256='"<hex>"' (the bundle manifest's
 * contract.names_sha256: its observation and action names and units in order, each action's
 * units_per_action and its control period), or pass
 * -H. Then it first asks the server for the served bundle's contract (a contract request) and refuses to
 * run against one whose hash differs: a plant that would send its observations in another order, units or
 * rate, or scale the actions for another drive, than the policy expects.
 *
 * Prints, when it checked the contract, a line (before it compares, so a refusal shows what is served)
 *   contract period_s=P names_sha256=H version=V obs_dim=N act_dim=M blind_horizon=K
 * and then one line:
 *   reply seq=N status=0xS latency_us=L version=V action=A0 A1 ... bits=H0 H1 ...
 * where bits are the IEEE-754 float32 words in hex (exact); with BLIND set, `blind=1` (or `blind=past_horizon`)
 * comes before action=. Exit status:
 * 0 reply received and verified, 1 usage/socket error, 2 no reply within 1 s (datagrams that are not
 * the server's signed reply to this request are skipped), 3 malformed reply, 4 the served bundle's
 * contract is not the one this client was built for, or takes other counts of observations or legacy
 * actions than given (nothing was sent to the policy), 5 reply received and verified, and it carries an
 * alarm bit (STATUS_ALARMS: a refusal, a fallback, BLIND_PAST_HORIZON): its action is still the one to apply.
 */
#define _POSIX_C_SOURCE 200809L
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define HEADER_SIZE 32
#define MAC_SIZE 32
#define MAX_FLOATS 256
#define MAX_KEY 1024
#define MIN_KEY 32
#define VERSION 2

#define CONTRACT_PAYLOAD 56 /* u32 version, u16 obs_dim, u16 act_dim, f64 period, 32 B names_sha256, u16 state kind, u16 state length, u32 blind horizon */
#define ESTIMATE_REQUEST_PAD 204 /* zero padding: room for the largest estimate reply */
#define ESTIMATE_HEAD 12         /* u32 version, u16 n, u16 reserved, u32 steps; then n f32 */
#define MAX_ESTIMATES 48

#ifndef S2R_NAMES_SHA256
#define S2R_NAMES_SHA256 "" /* not built for a particular bundle: no contract check unless -H */
#endif

enum { ACT_REQUEST = 1, ACT_REPLY = 2, CONTRACT_REQUEST = 5, CONTRACT_REPLY = 6, ESTIMATE_REQUEST = 7, ESTIMATE_REPLY = 8 };
enum { FLAG_HMAC = 1, FLAG_OBS_MISSING = 4 };
enum { STATUS_BLIND = 0x1000, STATUS_BLIND_PAST_HORIZON = 0x2000, STATUS_BACKUP = 0x4000 };
/* The alarm bits (protocol.md, "Status bits"): FALLBACK, BAD_INPUT, AUTH_FAILED, STALE, DEADLINE, INFERENCE_ERROR,
 * BUSY, BLIND_PAST_HORIZON. A reply carrying any is applied all the same, and the exit status says so (5). */
#define STATUS_ALARMS 0x22EEu

/* ---------------------------------------------------------------- SHA-256 */
typedef struct { uint32_t h[8]; uint64_t len; uint8_t buf[64]; size_t n; } sha256_ctx;

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(sha256_ctx *c, const uint8_t *p) {
    uint32_t w[64], a, b, d, e, f, g, h, cc, t1, t2;
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = c->h[0]; b = c->h[1]; cc = c->h[2]; d = c->h[3]; e = c->h[4]; f = c->h[5]; g = c->h[6]; h = c->h[7];
    for (int i = 0; i < 64; i++) {
        t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
        t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & cc) ^ (b & cc));
        h = g; g = f; f = e; e = d + t1; d = cc; cc = b; b = a; a = t1 + t2;
    }
    c->h[0] += a; c->h[1] += b; c->h[2] += cc; c->h[3] += d; c->h[4] += e; c->h[5] += f; c->h[6] += g; c->h[7] += h;
}

static void sha256_init(sha256_ctx *c) {
    static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(c->h, iv, sizeof iv);
    c->len = 0;
    c->n = 0;
}

static void sha256_update(sha256_ctx *c, const uint8_t *p, size_t n) {
    c->len += n;
    while (n--) {
        c->buf[c->n++] = *p++;
        if (c->n == 64) { sha256_block(c, c->buf); c->n = 0; }
    }
}

static void sha256_final(sha256_ctx *c, uint8_t out[32]) {
    uint64_t bits = c->len * 8;
    uint8_t pad = 0x80, zero = 0, lenbe[8];
    sha256_update(c, &pad, 1);
    while (c->n != 56) sha256_update(c, &zero, 1);
    for (int i = 0; i < 8; i++) lenbe[i] = (uint8_t)(bits >> (56 - 8 * i));
    sha256_update(c, lenbe, 8);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(c->h[i] >> 24); out[4 * i + 1] = (uint8_t)(c->h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(c->h[i] >> 8); out[4 * i + 3] = (uint8_t)c->h[i];
    }
}

static void hmac_sha256(const uint8_t *key, size_t klen, const uint8_t *msg, size_t n, uint8_t out[32]) {
    uint8_t k[64] = {0}, pad[64], inner[32];
    sha256_ctx c;
    if (klen > 64) { sha256_init(&c); sha256_update(&c, key, klen); sha256_final(&c, k); }
    else memcpy(k, key, klen);
    for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x36;
    sha256_init(&c); sha256_update(&c, pad, 64); sha256_update(&c, msg, n); sha256_final(&c, inner);
    for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x5c;
    sha256_init(&c); sha256_update(&c, pad, 64); sha256_update(&c, inner, 32); sha256_final(&c, out);
}

/* Constant-time compare: a MAC check must not leak how many bytes matched. */
static int mac_equal(const uint8_t *a, const uint8_t *b) {
    uint8_t diff = 0;
    for (int i = 0; i < MAC_SIZE; i++) diff |= a[i] ^ b[i];
    return diff == 0;
}

/* ------------------------------------------------------- little-endian I/O */
static void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static void put32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static void put64(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t get32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32; }
static uint32_t f32bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bitsf32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static uint64_t now_us(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static size_t read_key(const char *path, uint8_t *key) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); exit(1); }
    size_t n = fread(key, 1, MAX_KEY, f);
    fclose(f);
    while (n && (key[n - 1] == '\n' || key[n - 1] == '\r' || key[n - 1] == ' ' || key[n - 1] == '\t')) n--;
    if (n < MIN_KEY) { fprintf(stderr, "%s: key shorter than %d bytes\n", path, MIN_KEY); exit(1); }
    return n;
}

static int parse_csv(const char *s, float *out) {
    int n = 0;
    char *end;
    while (*s && n < MAX_FLOATS) {
        out[n++] = strtof(s, &end);
        if (end == s) return -1;
        s = (*end == ',') ? end + 1 : end;
    }
    return n;
}

/* Header: magic, version, type, flags, seq, timestamp_us, payload_len, client_id. */
static void put_header(uint8_t *p, int type, int keyed, uint64_t seq, uint32_t payload_len, uint32_t client_id,
                       uint16_t flags) {
    memcpy(p, "S2RP", 4);
    p[4] = VERSION;
    p[5] = (uint8_t)type;
    put16(p + 6, (uint16_t)(flags | (keyed ? FLAG_HMAC : 0)));
    put64(p + 8, seq);
    put64(p + 16, now_us(CLOCK_MONOTONIC));
    put32(p + 24, payload_len);
    put32(p + 28, client_id);
}

/* Wait (1 s from now at most) for the server's reply of `type` to request `seq` of `client_id`; returns its
 * length without the MAC, or -2 on timeout, -1 on a socket error. Datagrams that are not that reply (another
 * type, unsigned or forged with a key, a late reply to an earlier request, another plant's) are skipped. */
static ssize_t await_reply(int fd, uint8_t *rep, size_t cap, int type, uint64_t seq, uint32_t client_id,
                           const uint8_t *reply_key, int keyed) {
    uint8_t mac[MAC_SIZE];
    /* However many datagrams that are not our reply arrive meanwhile: each recv waits only for what is left. */
    uint64_t deadline = now_us(CLOCK_MONOTONIC) + 1000000u;
    for (;;) {
        uint64_t now = now_us(CLOCK_MONOTONIC);
        if (now >= deadline) return -2;
        struct timeval tv = {(time_t)((deadline - now) / 1000000u), (suseconds_t)((deadline - now) % 1000000u)};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        ssize_t n = recv(fd, rep, cap, 0);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;  /* the deadline check above ends it */
        if (n < 0) { fprintf(stderr, "recv: %s\n", strerror(errno)); return -1; }
        int signed_reply = n >= HEADER_SIZE && (get16(rep + 6) & FLAG_HMAC);
        /* Only the header is common to every reply (an estimate reply with no values is 44 bytes, shorter than any
         * act reply): each caller checks its own payload's length. */
        if (n < HEADER_SIZE + (signed_reply ? MAC_SIZE : 0) || memcmp(rep, "S2RP", 4) || rep[4] != VERSION || rep[5] != type)
            continue;  /* not a reply frame of this type: ignore */
        size_t body = (size_t)n - (signed_reply ? MAC_SIZE : 0);
        if (keyed) {  /* with a key, only a reply signed with it counts */
            hmac_sha256(reply_key, 32, rep, body, mac);
            if (!signed_reply || !mac_equal(mac, rep + body)) continue;  /* unsigned or forged: not the server's */
        }
        /* A late reply to an earlier request, or another plant's reply with the same seq: not ours. */
        if (get64(rep + 8) != seq || get32(rep + 28) != client_id) continue;
        return (ssize_t)body;
    }
}

/* Send a request of `type` whose payload is `pad` zero bytes (contract and estimate requests: the padding makes
 * a request at least as large as its reply) and wait for its reply (type + 1); returns await_reply's result, or -1
 * when the send fails. */
static ssize_t ask(int fd, int type, uint32_t pad, uint8_t *rep, size_t cap, uint64_t seq, uint32_t client_id,
                   const uint8_t *request_key, const uint8_t *reply_key, int keyed) {
    uint8_t req[HEADER_SIZE + ESTIMATE_REQUEST_PAD + MAC_SIZE] = {0};  /* the larger of the two paddings */
    put_header(req, type, keyed, seq, pad, client_id, 0);
    size_t len = HEADER_SIZE + pad;
    if (keyed) { hmac_sha256(request_key, 32, req, len, req + len); len += MAC_SIZE; }
    if (send(fd, req, len, 0) != (ssize_t)len) { perror("send"); return -1; }
    return await_reply(fd, rep, cap, type + 1, seq, client_id, reply_key, keyed);
}

/* Ask for the served bundle's contract, print it, and compare its names hash with `expected` (hex) and its
 * dimensions with this call's: 0 when both match, else the exit status (2 timeout, 3 malformed, 4 another contract
 * or other dimensions, 1 socket error). */
static int check_contract(int fd, const char *expected, int n_obs, int n_leg, uint64_t seq, uint32_t client_id,
                          const uint8_t *request_key, const uint8_t *reply_key, int keyed) {
    uint8_t rep[512];
    char got[65];
    ssize_t body = ask(fd, CONTRACT_REQUEST, CONTRACT_PAYLOAD, rep, sizeof rep, seq, client_id, request_key, reply_key,
                       keyed);
    if (body == -2) { fprintf(stderr, "timeout: no contract reply within 1 s\n"); return 2; }
    if (body < 0) return 1;
    if (body != HEADER_SIZE + CONTRACT_PAYLOAD || get32(rep + 24) != CONTRACT_PAYLOAD) {
        fprintf(stderr, "malformed contract reply\n");
        return 3;
    }
    const uint8_t *p = rep + HEADER_SIZE;
    uint64_t period_bits = get64(p + 8);
    double period;
    memcpy(&period, &period_bits, 8);
    int stated = 0;
    for (int i = 0; i < 32; i++) { snprintf(got + 2 * i, 3, "%02x", p[16 + i]); stated |= p[16 + i]; }
    if (!stated) got[0] = '\0';
    unsigned obs_dim = get16(p + 4), act_dim = get16(p + 6);
    /* The policy's state is not in the names hash (a history policy takes the same I/O): a controller that signals
     * new episodes (RESET_STATE) needs to know whether the served policy carries one. */
    unsigned kind = get16(p + 48), length = get16(p + 50);
    printf("contract period_s=%.9g names_sha256=%s version=%u obs_dim=%u act_dim=%u blind_horizon=%u policy_state=",
           period, got, get32(p), obs_dim, act_dim, get32(p + 52));
    if (kind == 0) printf("none\n");
    else if (kind == 1) printf("history:%u\n", length);
    else printf("kind%u:%u\n", kind, length);
    fflush(stdout);
    if (strcmp(got, expected) != 0) {
        fprintf(stderr, "refusing to run: the served bundle's I/O contract hashes to %s, this client was built for %s\n",
                stated ? got : "(none: no contract)", expected);
        return 4;
    }
    if ((unsigned)n_obs != obs_dim || (n_leg != 0 && (unsigned)n_leg != act_dim)) {
        /* The server would drop or refuse such a request: say which count is wrong instead of timing out. */
        fprintf(stderr, "refusing to send: the served bundle takes %u observations and %u legacy actions (or none), "
                "this call gives %d and %d\n", obs_dim, act_dim, n_obs, n_leg);
        return 4;
    }
    return 0;
}

/* Ask what the policy believes about this plant (its session: the same client_id as its act requests) and print
 * it: 0, or the exit status (2 timeout, 3 malformed, 1 socket error). */
static int read_estimate(int fd, uint64_t seq, uint32_t client_id, const uint8_t *request_key, const uint8_t *reply_key,
                         int keyed) {
    uint8_t rep[512];
    ssize_t body = ask(fd, ESTIMATE_REQUEST, ESTIMATE_REQUEST_PAD, rep, sizeof rep, seq, client_id, request_key,
                       reply_key, keyed);
    if (body == -2) { fprintf(stderr, "timeout: no estimate reply within 1 s\n"); return 2; }
    if (body < 0) return 1;
    uint16_t n = body >= HEADER_SIZE + ESTIMATE_HEAD ? get16(rep + 36) : 0;
    if (body < HEADER_SIZE + ESTIMATE_HEAD || n > MAX_ESTIMATES || get32(rep + 24) != ESTIMATE_HEAD + 4u * n ||
        (size_t)body != HEADER_SIZE + ESTIMATE_HEAD + 4u * n) {
        fprintf(stderr, "malformed estimate reply\n");
        return 3;
    }
    printf("estimate steps=%u n=%u values=", get32(rep + 40), n);
    for (int i = 0; i < n; i++) printf("%s%.9g", i ? " " : "", (double)bitsf32(get32(rep + 44 + 4 * i)));
    printf(" bits=");
    for (int i = 0; i < n; i++) printf("%s%08x", i ? " " : "", get32(rep + 44 + 4 * i));
    printf("\n");
    return 0;
}

int main(int argc, char **argv) {
    uint8_t key[MAX_KEY], req[HEADER_SIZE + 4 + 8 * MAX_FLOATS + MAC_SIZE], rep[2048];
    uint8_t request_key[32], reply_key[32];  /* one MAC key per direction, derived from the PSK */
    size_t klen = 0;
    float legacy[MAX_FLOATS];
    const char *expected = S2R_NAMES_SHA256;
    int n_leg = 0, opt, missing = 0, estimate = 0;
    while ((opt = getopt(argc, argv, "k:l:H:me")) != -1) {
        if (opt == 'k') klen = read_key(optarg, key);
        else if (opt == 'm') missing = 1;
        else if (opt == 'e') estimate = 1;
        else if (opt == 'H') expected = optarg;
        else if (opt == 'l' && (n_leg = parse_csv(optarg, legacy)) < 0) { fprintf(stderr, "bad -l list\n"); return 1; }
        else if (opt != 'l') {
            fprintf(stderr, "usage: %s [-k KEYFILE] [-l LEGACY_CSV] [-H NAMES_SHA256] [-m] [-e] HOST PORT OBS...\n", argv[0]);
            return 1;
        }
    }
    int n_obs = argc - optind - 2;
    if (n_obs < 1 || n_obs + n_leg > MAX_FLOATS) {
        fprintf(stderr, "usage: %s [-k KEYFILE] [-l LEGACY_CSV] [-H NAMES_SHA256] [-m] [-e] HOST PORT OBS...\n", argv[0]);
        return 1;
    }
    struct sockaddr_in addr = {0};
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t)atoi(argv[optind + 1]));
    if (inet_pton(AF_INET, argv[optind], &addr.sin_addr) != 1) { fprintf(stderr, "bad host %s\n", argv[optind]); return 1; }

    if (klen) {
        static const char req_label[] = "S2RP v2 request", rep_label[] = "S2RP v2 reply";
        hmac_sha256(key, klen, (const uint8_t *)req_label, sizeof req_label - 1, request_key);
        hmac_sha256(key, klen, (const uint8_t *)rep_label, sizeof rep_label - 1, reply_key);
    }

    uint64_t seq = now_us(CLOCK_REALTIME);  /* wall clock µs: within a keyed server's clock window, ahead of any earlier run */
    /* A random client_id per process, as PolicyClient's (names this plant's session on the server). */
    uint32_t client_id = (uint32_t)(seq ^ ((uint64_t)getpid() << 16));
    FILE *urandom = fopen("/dev/urandom", "rb");
    if (urandom) {
        if (fread(&client_id, sizeof client_id, 1, urandom) != 1) client_id = (uint32_t)(seq ^ ((uint64_t)getpid() << 16));
        fclose(urandom);
    }
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) { perror("socket"); return 1; }
    if (expected[0]) {
        int rc = check_contract(fd, expected, n_obs, n_leg, seq, client_id, request_key, reply_key, klen != 0);
        if (rc) return rc;
        seq += 1;  /* the contract request spent this one */
    }

    uint32_t payload_len = 4 + 4 * (uint32_t)(n_obs + n_leg);
    put_header(req, ACT_REQUEST, klen != 0, seq, payload_len, client_id, missing ? FLAG_OBS_MISSING : 0);
    put16(req + 32, (uint16_t)n_obs);
    put16(req + 34, (uint16_t)n_leg);
    for (int i = 0; i < n_obs; i++)  /* missing: NaN (0x7fc00000), the server ignores the values */
        put32(req + 36 + 4 * i, missing ? 0x7fc00000u : f32bits(strtof(argv[optind + 2 + i], NULL)));
    for (int i = 0; i < n_leg; i++) put32(req + 36 + 4 * (n_obs + i), f32bits(legacy[i]));
    size_t len = HEADER_SIZE + payload_len;
    if (klen) { hmac_sha256(request_key, 32, req, len, req + len); len += MAC_SIZE; }
    if (send(fd, req, len, 0) != (ssize_t)len) { perror("send"); return 1; }
    ssize_t body = await_reply(fd, rep, sizeof rep, ACT_REPLY, seq, client_id, reply_key, klen != 0);
    if (body == -2) { fprintf(stderr, "timeout: no reply within 1 s\n"); return 2; }
    if (body < 0) return 1;
    if (body < HEADER_SIZE + 16) { fprintf(stderr, "malformed reply\n"); return 3; }
    uint32_t plen = get32(rep + 24);
    uint16_t n_act = get16(rep + 44);
    if (HEADER_SIZE + plen != (size_t)body || plen != 16 + 4u * n_act) { fprintf(stderr, "malformed reply\n"); return 3; }
    uint32_t status = get32(rep + 32);
    printf("reply seq=%llu status=0x%x latency_us=%u version=%u ", (unsigned long long)seq, status, get32(rep + 36),
           get32(rep + 40));
    if (status & STATUS_BLIND) printf("blind=%s ", status & STATUS_BLIND_PAST_HORIZON ? "past_horizon" : "1");
    if (status & STATUS_BACKUP) printf("backup=1 ");
    printf("action=");
    for (int i = 0; i < n_act; i++) printf("%s%.9g", i ? " " : "", (double)bitsf32(get32(rep + 48 + 4 * i)));
    printf(" bits=");
    for (int i = 0; i < n_act; i++) printf("%s%08x", i ? " " : "", get32(rep + 48 + 4 * i));
    printf("\n");
    int rc = estimate ? read_estimate(fd, seq + 1, client_id, request_key, reply_key, klen != 0) : 0;
    return rc ? rc : (status & STATUS_ALARMS) ? 5 : 0;
}
