/*
 * ipward-cni: the node's CNI IPAM plugin, one statically linked executable that needs
 * nothing of the host (no interpreter, no shell, no C library). `ipward install-cni
 * --standalone` installs it; `build.sh` beside it builds it (docs/architecture.md
 * "Plugin start path").
 *
 * It forwards ADD, DEL, CHECK, GC and STATUS to the node's agent over wire protocol 2
 * (docs/design.md 5.12) and prints the agent's answer verbatim; it answers VERSION
 * itself; a call it cannot forward gets the CNI error object. It takes the decisions of
 * the Python forwarder (src/ipward/cni/plugin.py, wire.py, notes.py, cniio.py), in the
 * same words: tests/system runs both on the same calls and compares what they print.
 * - Where a call goes: only the parsed config's `ipam.agentSocket` (else
 *   `ipam.agent_socket`; of duplicate keys the last counts, as in Python's json).
 * - Whom it talks to: a socket file owned by root or the plugin's user, whose listener
 *   (SO_PEERCRED) is root or that user too, checked before a byte is sent; else 5.
 * - Limits: stdin 1 MiB (107), a forwarded variable 128 KiB, an answer 4 MiB; one
 *   deadline of 60 s for the call; a full listen backlog is waited out.
 * - A DEL never wedges a pod (docs/design.md 5.14): an ADD leaves a note before it is
 *   sent, a DEL served removes it, a DEL without an answer succeeds when there is none.
 * Nothing else is read from the host: no locale, no name service, no /proc.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define MAX_CONFIG (1 << 20)     /* bytes of network configuration (README: Limits) */
#define MAX_VALUE (128 << 10)    /* bytes of one forwarded variable */
#define MAX_ANSWER (4 << 20)     /* bytes of the agent's stdout */
#define MAX_SOCKET_PATH 107      /* sun_path holds 108 with its NUL */
#define CALL_TIMEOUT_MS 60000    /* the whole call: connect, send, the answer */
#define NAME_MAX_BYTES 255       /* a note's path component */
#define MAX_MESSAGE 2000         /* characters of an error's msg */
/* As deep as Python 3.11's json scanner goes on the forwarder's path before its
 * recursion limit (containers nested); Python's int() refuses longer integers. */
#define MAX_DEPTH 995
#define MAX_INT_DIGITS 4300
#define NOTES_DIR "/var/lib/cni/ipward"

enum { OK_STATUS = 0, ERROR_STATUS = 1 };
enum code { IO_FAILURE = 5, DECODE_FAILURE = 6, INVALID_CONFIG = 7, TRY_AGAIN = 11,
            NOT_AVAILABLE = 50, TOO_LARGE = 107 };

static const char *const SUPPORTED[] = {"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"};
static const char *const FORWARDED[] = {"CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS",
                                        "CNI_IFNAME", "CNI_ARGS"};
#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

static const char NO_ANSWER[] =
    "the agent closed the connection without answering (it stopped, or it is older than"
    " this plugin and does not speak wire protocol 2)";
static const char NO_IN_PROCESS[] =
    "this ipward plugin (installed by `ipward install-cni --standalone`) forwards every"
    " call to the node agent and has no in-process mode: set ipam.agentSocket to the"
    " agent's socket (e.g. /run/ipward/agent.sock)";

/* -- memory: every allocation of one call, freed together ---------------------------- */

struct block { struct block *next; max_align_t data[]; };
static struct block *blocks;

static void out_of_memory(void) {
    static const char answer[] =
        "{\"cniVersion\":\"1.1.0\",\"code\":11,\"msg\":\"ipward plugin: out of memory\"}\n";
    (void)!write(1, answer, sizeof answer - 1);
    _exit(ERROR_STATUS);
}

static void *allocate(size_t n) {
    struct block *b = malloc(sizeof *b + n);
    if (!b) out_of_memory();
    b->next = blocks;
    blocks = b;
    return b->data;
}

static void free_all(void) {
    while (blocks) {
        struct block *next = blocks->next;
        free(blocks);
        blocks = next;
    }
}

struct buf { char *data; size_t len, cap; };

static void put(struct buf *b, const void *p, size_t n) {
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n) cap *= 2;
        char *data = allocate(cap);
        if (b->len) memcpy(data, b->data, b->len);
        b->data = data;
        b->cap = cap;
    }
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
}

static void puts_(struct buf *b, const char *s) { put(b, s, strlen(s)); }

static void vputf(struct buf *b, const char *fmt, va_list ap) {
    va_list again;
    va_copy(again, ap);
    int n = vsnprintf(NULL, 0, fmt, again);
    va_end(again);
    if (n <= 0) return;
    char *formatted = allocate((size_t)n + 1);
    vsnprintf(formatted, (size_t)n + 1, fmt, ap);
    put(b, formatted, (size_t)n);
}

static void putf(struct buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vputf(b, fmt, ap);
    va_end(ap);
}

static const char *text(struct buf *b) { /* NUL-terminated contents */
    put(b, "", 1);
    b->len--;
    return b->data;
}

/* glibc's words for the errors the plugin's calls can meet: the Python forwarder, on a
 * glibc interpreter, says the same (musl words some differently). */
static const char *error_text(int e) {
    switch (e) {
    case EPERM: return "Operation not permitted";
    case ENOENT: return "No such file or directory";
    case EINTR: return "Interrupted system call";
    case EIO: return "Input/output error";
    case ENXIO: return "No such device or address";
    case EBADF: return "Bad file descriptor";
    case EAGAIN: return "Resource temporarily unavailable";
    case ENOMEM: return "Cannot allocate memory";
    case EACCES: return "Permission denied";
    case EFAULT: return "Bad address";
    case EEXIST: return "File exists";
    case ENOTDIR: return "Not a directory";
    case EISDIR: return "Is a directory";
    case EINVAL: return "Invalid argument";
    case ENFILE: return "Too many open files in system";
    case EMFILE: return "Too many open files";
    case ENOSPC: return "No space left on device";
    case EROFS: return "Read-only file system";
    case EMLINK: return "Too many links";
    case EPIPE: return "Broken pipe";
    case ENAMETOOLONG: return "File name too long";
    case ELOOP: return "Too many levels of symbolic links";
    case EOVERFLOW: return "Value too large for defined data type";
    case ENOTSOCK: return "Socket operation on non-socket";
    case EPROTOTYPE: return "Protocol wrong type for socket";
    case EAFNOSUPPORT: return "Address family not supported by protocol";
    case EADDRNOTAVAIL: return "Cannot assign requested address";
    case ENOBUFS: return "No buffer space available";
    case ECONNRESET: return "Connection reset by peer";
    case ETIMEDOUT: return "Connection timed out";
    case ECONNREFUSED: return "Connection refused";
    case EDQUOT: return "Disk quota exceeded";
    default: {
        static char unknown[32];
        snprintf(unknown, sizeof unknown, "Unknown error %d", e);
        return unknown;
    }
    }
}

/* -- UTF-8 ------------------------------------------------------------------------------ */

/* The length of the well-formed UTF-8 sequence at s[0..n), as Python's strict decoder
 * takes it (no overlongs, surrogates or code points past U+10FFFF); 0 if there is none.
 * With `lone_surrogates`, ED A0..BF (a surrogate, which a JSON \u escape can make) too. */
static size_t utf8_sequence(const unsigned char *s, size_t n, int lone_surrogates) {
    unsigned char c = s[0];
    if (c < 0x80) return 1;
    size_t len = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3
               : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (!len) return 0;
    unsigned char lo = 0x80, hi = 0xBF; /* the second byte's range */
    if (c == 0xE0) lo = 0xA0;
    else if (c == 0xED && !lone_surrogates) hi = 0x9F;
    else if (c == 0xF0) lo = 0x90;
    else if (c == 0xF4) hi = 0x8F;
    for (size_t i = 1; i < len; i++) {
        if (i >= n) return 0;
        if (i == 1 ? s[1] < lo || s[1] > hi : (s[i] & 0xC0) != 0x80) return 0;
    }
    return len;
}

/* Whether s[0..k) begins some well-formed sequence (and is not all of it). */
static int fits(const unsigned char *s, size_t k) {
    unsigned char c = s[0];
    size_t len = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3
               : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (k >= len) return 0;
    unsigned char lo = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80;
    unsigned char hi = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
    for (size_t i = 1; i < k; i++)
        if (i == 1 ? s[1] < lo || s[1] > hi : (s[i] & 0xC0) != 0x80) return 0;
    return 1;
}

/* The code point of the sequence at s (of length `len`, as utf8_sequence found it). */
static uint32_t code_point(const unsigned char *s, size_t len) {
    if (len == 1) return s[0];
    uint32_t c = s[0] & (0x7F >> len);
    for (size_t i = 1; i < len; i++) c = c << 6 | (s[i] & 0x3F);
    return c;
}

static void put_utf8(struct buf *b, uint32_t c) {
    unsigned char s[4];
    size_t n;
    if (c < 0x80) { s[0] = (unsigned char)c; n = 1; }
    else if (c < 0x800) { s[0] = 0xC0 | c >> 6; s[1] = 0x80 | (c & 0x3F); n = 2; }
    else if (c < 0x10000) {
        s[0] = 0xE0 | c >> 12; s[1] = 0x80 | (c >> 6 & 0x3F); s[2] = 0x80 | (c & 0x3F); n = 3;
    } else {
        s[0] = 0xF0 | c >> 18; s[1] = 0x80 | (c >> 12 & 0x3F);
        s[2] = 0x80 | (c >> 6 & 0x3F); s[3] = 0x80 | (c & 0x3F); n = 4;
    }
    put(b, s, n);
}

/* Bytes as Python's bytes.decode("utf-8", "replace") reads them: each maximal part of
 * an ill-formed sequence (a start byte and the continuation bytes that fit it, or one
 * byte that starts nothing) becomes U+FFFD. */
static void put_replacing(struct buf *b, const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        size_t len = utf8_sequence(s + i, n - i, 0);
        if (len) {
            put(b, s + i, len);
            i += len;
            continue;
        }
        size_t part = 1;
        while (i + part < n && part < 3 && utf8_sequence(s + i, part + 1, 0) == 0
               && fits(s + i, part + 1))
            part++;
        puts_(b, "\xEF\xBF\xBD");
        i += part;
    }
}

/* -- JSON: Python's json module's language (NaN and Infinity too), parsed as it parses -- */

enum kind { J_NULL, J_FALSE, J_TRUE, J_INT, J_FLOAT, J_STRING, J_ARRAY, J_OBJECT };

struct value {
    enum kind kind;
    const char *text; /* a string's code points (UTF-8; lone surrogates as ED xx xx),
                         NUL-terminated; a number's literal */
    size_t len;
    double number;                   /* J_FLOAT */
    struct member *first, *last;     /* J_ARRAY items, J_OBJECT members, in order */
    size_t count;
};
struct member { struct member *next; struct value *key, *value; };

struct parser {
    const unsigned char *s;
    size_t n, at;
    int depth;
    const char *problem; /* why it is not JSON, once it is known */
};

static int fail(struct parser *p, const char *problem) {
    if (!p->problem) p->problem = problem;
    return 0;
}

static int blank(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static void skip_blanks(struct parser *p) {
    while (p->at < p->n && blank(p->s[p->at])) p->at++;
}

static int hex4(const unsigned char *s, uint32_t *out) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        unsigned char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return 0;
        v = v << 4 | (uint32_t)d;
    }
    *out = v;
    return 1;
}

static int parse_value(struct parser *p, struct value **out);

static int parse_string(struct parser *p, struct value **out) {
    struct buf decoded = {0};
    p->at++; /* the opening quote */
    for (;;) {
        if (p->at >= p->n) return fail(p, "Unterminated string");
        unsigned char c = p->s[p->at];
        if (c == '"') { p->at++; break; }
        if (c < 0x20) return fail(p, "Invalid control character in a string");
        if (c != '\\') {
            size_t len = utf8_sequence(p->s + p->at, p->n - p->at, 0);
            put(&decoded, p->s + p->at, len); /* the input is well-formed: len >= 1 */
            p->at += len;
            continue;
        }
        if (p->at + 1 >= p->n) return fail(p, "Unterminated string");
        c = p->s[p->at + 1];
        const char *simple = strchr("\"\\/bfnrt", c);
        if (c && simple) {
            static const char meaning[] = "\"\\/\b\f\n\r\t";
            put(&decoded, &meaning[simple - "\"\\/bfnrt"], 1);
            p->at += 2;
            continue;
        }
        if (c != 'u') return fail(p, "Invalid \\escape");
        uint32_t cp, low;
        if (p->at + 6 > p->n || !hex4(p->s + p->at + 2, &cp)) return fail(p, "Invalid \\uXXXX escape");
        p->at += 6;
        if (cp >= 0xD800 && cp <= 0xDBFF && p->at + 6 <= p->n && p->s[p->at] == '\\'
            && p->s[p->at + 1] == 'u') {
            if (!hex4(p->s + p->at + 2, &low)) return fail(p, "Invalid \\uXXXX escape");
            if (low >= 0xDC00 && low <= 0xDFFF) {
                cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
                p->at += 6;
            }
        }
        put_utf8(&decoded, cp);
    }
    struct value *v = allocate(sizeof *v);
    *v = (struct value){.kind = J_STRING, .text = text(&decoded), .len = decoded.len};
    *out = v;
    return 1;
}

static int parse_number(struct parser *p, struct value **out) {
    size_t start = p->at, digits = 0;
    int fractional = 0;
    if (p->s[p->at] == '-') p->at++;
    if (p->at < p->n && p->s[p->at] == '0') { p->at++; digits = 1; }
    else while (p->at < p->n && p->s[p->at] >= '0' && p->s[p->at] <= '9') { p->at++; digits++; }
    if (!digits) return fail(p, "Expecting value");
    if (p->at + 1 < p->n && p->s[p->at] == '.' && p->s[p->at + 1] >= '0' && p->s[p->at + 1] <= '9') {
        fractional = 1;
        p->at += 2;
        while (p->at < p->n && p->s[p->at] >= '0' && p->s[p->at] <= '9') p->at++;
    }
    if (p->at < p->n && (p->s[p->at] == 'e' || p->s[p->at] == 'E')) {
        size_t e = p->at + 1;
        if (e < p->n && (p->s[e] == '+' || p->s[e] == '-')) e++;
        if (e < p->n && p->s[e] >= '0' && p->s[e] <= '9') {
            fractional = 1;
            while (e < p->n && p->s[e] >= '0' && p->s[e] <= '9') e++;
            p->at = e;
        }
    }
    if (!fractional && digits > MAX_INT_DIGITS)
        return fail(p, "an integer of more digits than Python converts");
    struct value *v = allocate(sizeof *v);
    *v = (struct value){.kind = fractional ? J_FLOAT : J_INT,
                        .text = (const char *)p->s + start, .len = p->at - start};
    if (fractional) { /* strtod needs a NUL after the literal */
        char *literal = allocate(v->len + 1);
        memcpy(literal, v->text, v->len);
        literal[v->len] = 0;
        v->number = strtod(literal, NULL);
    }
    *out = v;
    return 1;
}

static int parse_word(struct parser *p, const char *word, enum kind kind, double number,
                      struct value **out) {
    size_t n = strlen(word);
    if (p->n - p->at < n || memcmp(p->s + p->at, word, n) != 0) return fail(p, "Expecting value");
    p->at += n;
    struct value *v = allocate(sizeof *v);
    *v = (struct value){.kind = kind, .number = number};
    *out = v;
    return 1;
}

static void append(struct value *container, struct value *key, struct value *item) {
    struct member *m = allocate(sizeof *m);
    *m = (struct member){.key = key, .value = item};
    if (container->last) container->last->next = m;
    else container->first = m;
    container->last = m;
    container->count++;
}

static int parse_container(struct parser *p, struct value **out) {
    int object = p->s[p->at] == '{';
    if (++p->depth > MAX_DEPTH) return fail(p, "JSON nested too deeply");
    struct value *v = allocate(sizeof *v);
    *v = (struct value){.kind = object ? J_OBJECT : J_ARRAY};
    p->at++;
    skip_blanks(p);
    if (p->at < p->n && p->s[p->at] == (object ? '}' : ']')) {
        p->at++;
        p->depth--;
        *out = v;
        return 1;
    }
    for (;;) {
        struct value *key = NULL, *item;
        if (object) {
            if (p->at >= p->n || p->s[p->at] != '"')
                return fail(p, "Expecting property name enclosed in double quotes");
            if (!parse_string(p, &key)) return 0;
            skip_blanks(p);
            if (p->at >= p->n || p->s[p->at] != ':') return fail(p, "Expecting ':' delimiter");
            p->at++;
            skip_blanks(p);
        }
        if (!parse_value(p, &item)) return 0;
        append(v, key, item);
        skip_blanks(p);
        if (p->at < p->n && p->s[p->at] == (object ? '}' : ']')) break;
        if (p->at >= p->n || p->s[p->at] != ',') return fail(p, "Expecting ',' delimiter");
        p->at++;
        skip_blanks(p);
    }
    p->at++;
    p->depth--;
    *out = v;
    return 1;
}

static int parse_value(struct parser *p, struct value **out) {
    if (p->at >= p->n) return fail(p, "Expecting value");
    switch (p->s[p->at]) {
    case '"': return parse_string(p, out);
    case '{': case '[': return parse_container(p, out);
    case 'n': return parse_word(p, "null", J_NULL, 0, out);
    case 't': return parse_word(p, "true", J_TRUE, 0, out);
    case 'f': return parse_word(p, "false", J_FALSE, 0, out);
    case 'N': return parse_word(p, "NaN", J_FLOAT, NAN, out);
    case 'I': return parse_word(p, "Infinity", J_FLOAT, INFINITY, out);
    case '-':
        if (p->at + 1 < p->n && p->s[p->at + 1] == 'I')
            return parse_word(p, "-Infinity", J_FLOAT, -INFINITY, out);
        return parse_number(p, out);
    default:
        if (p->s[p->at] >= '0' && p->s[p->at] <= '9') return parse_number(p, out);
        return fail(p, "Expecting value");
    }
}

/* The document in s[0..n), or NULL with `why` and `where` (a byte offset) set. */
static struct value *parse_json(const unsigned char *s, size_t n, const char **why, size_t *where) {
    struct parser p = {.s = s, .n = n};
    for (size_t i = 0; i < n;) { /* Python decodes the whole text before parsing */
        size_t len = utf8_sequence(s + i, n - i, 0);
        if (!len) { *why = "not UTF-8"; *where = i; return NULL; }
        i += len;
    }
    struct value *v;
    skip_blanks(&p);
    if (parse_value(&p, &v)) {
        skip_blanks(&p);
        if (p.at == n) return v;
        fail(&p, "Extra data");
    }
    *why = p.problem;
    *where = p.at;
    return NULL;
}

static int is_string(const struct value *v, const char *s) {
    return v && v->kind == J_STRING && v->len == strlen(s) && memcmp(v->text, s, v->len) == 0;
}

/* obj[key] as a Python dict holds it (the last of duplicate keys); NULL when absent or
 * `obj` is no object. */
static const struct value *member(const struct value *obj, const char *key) {
    const struct value *found = NULL;
    if (!obj || obj->kind != J_OBJECT) return NULL;
    for (const struct member *m = obj->first; m; m = m->next)
        if (is_string(m->key, key)) found = m->value;
    return found;
}

static int has_lone_surrogate(const struct value *s) {
    for (size_t i = 0; i + 1 < s->len; i++)
        if ((unsigned char)s->text[i] == 0xED && (unsigned char)s->text[i + 1] >= 0xA0) return 1;
    return 0;
}

/* -- JSON out: Python's json.dumps(obj, separators=(",", ":")), ASCII only ------------- */

static void put_escaped(struct buf *b, const char *s, size_t n, size_t limit) {
    size_t chars = 0;
    for (size_t i = 0; i < n; chars++) {
        if (chars == limit) { puts_(b, " [...]"); return; }
        size_t len = utf8_sequence((const unsigned char *)s + i, n - i, 1);
        uint32_t c = code_point((const unsigned char *)s + i, len);
        i += len;
        const char *short_form = c == '"' ? "\\\"" : c == '\\' ? "\\\\" : c == '\n' ? "\\n"
                               : c == '\r' ? "\\r" : c == '\t' ? "\\t" : c == '\b' ? "\\b"
                               : c == '\f' ? "\\f" : NULL;
        if (short_form) puts_(b, short_form);
        else if (c >= 0x20 && c <= 0x7E) { char ch = (char)c; put(b, &ch, 1); }
        else if (c >= 0x10000) {
            c -= 0x10000;
            putf(b, "\\u%04x\\u%04x", 0xD800 + (c >> 10), 0xDC00 + (c & 0x3FF));
        } else putf(b, "\\u%04x", c);
    }
}

static void put_string(struct buf *b, const char *s, size_t n, size_t limit) {
    puts_(b, "\"");
    put_escaped(b, s, n, limit);
    puts_(b, "\"");
}

/* repr(x) of a Python float: the shortest digits that read back as x (the closest of
 * them), fixed notation for decimal exponents -4..15, else d.ddde+XX. */
static void put_float(struct buf *b, double x) {
    if (isnan(x)) { puts_(b, "NaN"); return; }
    if (isinf(x)) { puts_(b, x < 0 ? "-Infinity" : "Infinity"); return; }
    if (signbit(x)) puts_(b, "-");
    x = fabs(x);
    char tmp[48], digits[24];
    uint64_t m = 0;
    int exp10 = 0, p;
    for (p = 1; p <= 17; p++) {
        snprintf(tmp, sizeof tmp, "%.*e", p - 1, x);
        double back = strtod(tmp, NULL);
        m = 0;
        exp10 = atoi(strchr(tmp, 'e') + 1);
        for (const char *c = tmp; *c != 'e'; c++)
            if (*c >= '0' && *c <= '9') m = m * 10 + (uint64_t)(*c - '0');
        if (back == x) break;
        /* The nearest p digits miss x: their neighbour on x's other side may not (next
         * to a power of two, where the gap below x is half the gap above). */
        uint64_t low = 1;
        for (int i = 1; i < p; i++) low *= 10;
        if (back < x) { if (++m == low * 10) { m = low; exp10++; } }
        else if (m-- == low) { m = low * 10 - 1; exp10--; }
        snprintf(tmp, sizeof tmp, "%llue%d", (unsigned long long)m, exp10 - (p - 1));
        if (strtod(tmp, NULL) == x) break;
    }
    int n = snprintf(digits, sizeof digits, "%llu", (unsigned long long)m);
    while (n > 1 && digits[n - 1] == '0') digits[--n] = 0;
    int point = exp10 + 1; /* digits before the decimal point */
    if (point > -4 && point <= 16) {
        if (point <= 0) {
            puts_(b, "0.");
            for (int i = point; i < 0; i++) puts_(b, "0");
            put(b, digits, (size_t)n);
        } else if (point >= n) {
            put(b, digits, (size_t)n);
            for (int i = n; i < point; i++) puts_(b, "0");
            puts_(b, ".0");
        } else {
            put(b, digits, (size_t)point);
            puts_(b, ".");
            put(b, digits + point, (size_t)(n - point));
        }
    } else {
        put(b, digits, 1);
        if (n > 1) { puts_(b, "."); put(b, digits + 1, (size_t)(n - 1)); }
        putf(b, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
    }
}

static uint64_t hash_key(const struct value *key) {
    uint64_t h = 1469598103934665603u; /* FNV-1a */
    for (size_t i = 0; i < key->len; i++) h = (h ^ (unsigned char)key->text[i]) * 1099511628211u;
    return h;
}

static int same_key(const struct value *a, const struct value *b) {
    return a->len == b->len && memcmp(a->text, b->text, a->len) == 0;
}

static void put_json(struct buf *b, const struct value *v) {
    switch (v->kind) {
    case J_NULL: puts_(b, "null"); return;
    case J_FALSE: puts_(b, "false"); return;
    case J_TRUE: puts_(b, "true"); return;
    case J_INT: /* Python's int: -0 is 0, other literals are as written */
        if (v->len == 2 && memcmp(v->text, "-0", 2) == 0) puts_(b, "0");
        else put(b, v->text, v->len);
        return;
    case J_FLOAT: put_float(b, v->number); return;
    case J_STRING: put_string(b, v->text, v->len, SIZE_MAX); return;
    case J_ARRAY:
        puts_(b, "[");
        for (const struct member *m = v->first; m; m = m->next) {
            if (m != v->first) puts_(b, ",");
            put_json(b, m->value);
        }
        puts_(b, "]");
        return;
    case J_OBJECT: {
        /* A dict: each key once, where it first came, with the value it came with last.
         * A table of the members by key finds each key's first and last. */
        size_t slots = 2;
        while (slots < 2 * v->count) slots *= 2;
        const struct member **first = allocate(slots * sizeof *first);
        const struct member **last = allocate(slots * sizeof *last);
        memset(first, 0, slots * sizeof *first);
        for (const struct member *m = v->first; m; m = m->next) {
            size_t i = hash_key(m->key) & (slots - 1);
            while (first[i] && !same_key(first[i]->key, m->key)) i = (i + 1) & (slots - 1);
            if (!first[i]) first[i] = m;
            last[i] = m;
        }
        puts_(b, "{");
        int any = 0;
        for (const struct member *m = v->first; m; m = m->next) {
            size_t i = hash_key(m->key) & (slots - 1);
            while (!same_key(first[i]->key, m->key)) i = (i + 1) & (slots - 1);
            if (first[i] != m) continue;
            if (any++) puts_(b, ",");
            put_json(b, m->key);
            puts_(b, ":");
            put_json(b, last[i]->value);
        }
        puts_(b, "}");
        return;
    }
    }
}

/* -- the call --------------------------------------------------------------------------- */

struct call {
    const unsigned char *stdin_;
    size_t stdin_len;
    const char *command;        /* CNI_COMMAND, NULL when unset */
    const struct value *config; /* the parsed config (NULL: over the limit or not JSON) */
    struct buf out;             /* what is printed */
};

static int is_command(const struct call *c, const char *name) {
    return c->command && strcmp(c->command, name) == 0;
}

/* The CNI error object, in the config's cniVersion when we support it (else the
 * latest); its msg cut to MAX_MESSAGE characters. */
static int error_answer(struct call *c, int code, const char *msg) {
    const char *version = SUPPORTED[COUNT(SUPPORTED) - 1];
    const struct value *asked = member(c->config, "cniVersion");
    for (size_t i = 0; i < COUNT(SUPPORTED); i++)
        if (is_string(asked, SUPPORTED[i])) version = SUPPORTED[i];
    c->out.len = 0;
    putf(&c->out, "{\"cniVersion\":\"%s\",\"code\":%d,\"msg\":", version, code);
    put_string(&c->out, msg, strlen(msg), MAX_MESSAGE);
    puts_(&c->out, "}\n");
    return ERROR_STATUS;
}

/* What makes `v` unusable as the agent's socket path, or NULL (wire.socket_path_problem). */
static const char *socket_path_problem(const struct value *v) {
    if (!v || v->kind != J_STRING) return "must be a string";
    if (has_lone_surrogate(v)) return "must be Unicode text (it has a lone surrogate)";
    if (!v->len || v->text[0] != '/') return "must be an absolute path";
    if (memchr(v->text, 0, v->len)) return "must not contain a NUL byte";
    if (v->len > MAX_SOCKET_PATH)
        return "is longer than a Unix socket path can be (107 bytes)";
    return NULL;
}

/* The agent socket the config names (wire.agent_socket), or NULL. */
static const char *agent_socket(const struct value *config) {
    const struct value *ipam = member(config, "ipam");
    if (!ipam || ipam->kind != J_OBJECT) return NULL;
    const struct value *path = member(ipam, "agentSocket");
    if (!path) path = member(ipam, "agent_socket");
    return socket_path_problem(path) ? NULL : path->text;
}

/* -- notes (docs/design.md 5.14, cni/notes.py) ------------------------------------------ */

static int note_component(const char *s, size_t n) {
    return n > 0 && n <= NAME_MAX_BYTES && !memchr(s, '/', n) && !memchr(s, 0, n)
        && !(n == 1 && s[0] == '.') && !(n == 2 && s[0] == '.' && s[1] == '.');
}

/* The note of the call's attachment (the config's name, CNI_CONTAINERID, CNI_IFNAME),
 * or NULL when they name none. */
static const char *note_path(const struct call *c) {
    const struct value *network = member(c->config, "name");
    const char *container = getenv("CNI_CONTAINERID"), *ifname = getenv("CNI_IFNAME");
    if (!network || network->kind != J_STRING || has_lone_surrogate(network)
        || !note_component(network->text, network->len) || !container
        || !note_component(container, strlen(container)) || !ifname
        || !note_component(ifname, strlen(ifname)))
        return NULL;
    const char *top = getenv("IPWARD_CNI_NOTES");
    struct buf path = {0};
    puts_(&path, top && *top ? top : NOTES_DIR);
    puts_(&path, "/");
    put(&path, network->text, network->len);
    puts_(&path, "/");
    puts_(&path, container);
    puts_(&path, "/");
    puts_(&path, ifname);
    return text(&path);
}

static int held(const char *note) {
    struct stat st;
    return note && (lstat(note, &st) == 0 || errno != ENOENT);
}

static void parent_of(char *path) { /* cut at the last '/' ("" when there is none) */
    char *slash = strrchr(path, '/');
    *(slash ? slash : path) = 0;
}

static int make_dirs(const char *path) {
    if (!*path || mkdir(path, 0700) == 0 || errno == EEXIST) return 0;
    if (errno != ENOENT) return -1;
    struct buf parent = {0};
    puts_(&parent, path);
    parent_of((char *)text(&parent));
    if (make_dirs(parent.data) != 0) return -1;
    return mkdir(path, 0700) == 0 || errno == EEXIST ? 0 : -1;
}

/* Note that an ADD of this attachment is about to be sent to `agent`; -1 with errno. */
static int write_note(const char *note, const char *agent) {
    struct buf dir = {0};
    puts_(&dir, note);
    parent_of((char *)text(&dir));
    if (make_dirs(dir.data) != 0) return -1;
    int fd = open(note, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return -1;
    struct buf line = {0};
    puts_(&line, agent);
    puts_(&line, "\n");
    for (size_t at = 0; at < line.len;) {
        ssize_t n = write(fd, line.data + at, line.len - at);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { int e = errno; close(fd); errno = e; return -1; }
        at += (size_t)n;
    }
    close(fd);
    return 0;
}

static void remove_note(const char *note) { /* best effort, as notes.remove */
    if (!note || unlink(note) != 0) return;
    struct buf dir = {0};
    puts_(&dir, note);
    parent_of((char *)text(&dir));
    rmdir(dir.data);
}

/* -- the agent (wire protocol 2, cni/wire.py) -------------------------------------------- */

struct failure {
    int refused; /* retrying cannot help: 5, nothing was sent */
    int note;    /* the ADD's note could not be written: 11, nothing was sent */
    struct buf reason;
};

static int failed(struct failure *f, int refused, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vputf(&f->reason, fmt, ap);
    va_end(ap);
    f->refused = refused;
    return -1;
}

static int failed_call(struct failure *f, const char *step, int e) {
    return failed(f, e == EACCES || e == EPERM, "%s: %s", step, error_text(e));
}

static void put_field(struct buf *b, const void *data, size_t n) {
    unsigned char length[4] = {n >> 24, n >> 16 & 0xFF, n >> 8 & 0xFF, n & 0xFF};
    put(b, length, 4);
    put(b, data, n);
}

static uint32_t big_endian(const unsigned char *s) {
    return (uint32_t)s[0] << 24 | (uint32_t)s[1] << 16 | (uint32_t)s[2] << 8 | s[3];
}

/* The request: the FORWARDED variables that are set, as they are, and stdin. */
static int encode_request(const struct call *c, struct buf *request, struct failure *f) {
    struct buf body = {0};
    unsigned char count = 0;
    put(&body, &count, 1);
    for (size_t i = 0; i < COUNT(FORWARDED); i++) {
        const char *value = getenv(FORWARDED[i]);
        if (!value) continue;
        if (strlen(value) > MAX_VALUE)
            return failed(f, 0, "%s is larger than %d bytes", FORWARDED[i], MAX_VALUE);
        put_field(&body, FORWARDED[i], strlen(FORWARDED[i]));
        put_field(&body, value, strlen(value));
        body.data[0] = (char)++count;
    }
    put_field(&body, c->stdin_, c->stdin_len);
    puts_(request, "IPWARDQ\x02");
    put_field(request, body.data, body.len);
    return 0;
}

static long long now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* Wait until `fd` is ready for `events` before the deadline; 0, or -1 with errno
 * (ETIMEDOUT when the deadline passed). */
static int wait_for(int fd, short events, long long deadline) {
    for (;;) {
        long long left = deadline - now_ms();
        if (left <= 0) { errno = ETIMEDOUT; return -1; }
        struct pollfd pfd = {.fd = fd, .events = events};
        int n = poll(&pfd, 1, (int)left);
        if (n > 0) return 0;
        if (n < 0 && errno != EINTR) return -1;
    }
}

/* n bytes of the answer into `into`; 0, or -1: ECONNRESET, ETIMEDOUT, or 0 with
 * *got < n when the agent closed first. */
static int receive(int fd, struct buf *into, size_t n, size_t *got, long long deadline) {
    *got = 0;
    while (*got < n) {
        size_t want = n - *got < 65536 ? n - *got : 65536;
        char chunk[65536];
        ssize_t r = recv(fd, chunk, want, 0);
        if (r > 0) { put(into, chunk, (size_t)r); *got += (size_t)r; continue; }
        if (r == 0) return 0;
        if (errno == EINTR) continue;
        if (errno != EAGAIN || wait_for(fd, POLLIN, deadline) != 0) return -1;
    }
    return 0;
}

/* The agent's answer on `fd`: its exit status, and its stdout into `out`. */
static int read_answer(int fd, struct buf *out, long long deadline, struct failure *f) {
    struct buf head = {0};
    size_t got;
    if (receive(fd, &head, 13, &got, deadline) != 0) {
        if (errno == ECONNRESET) return failed(f, 0, "%s: %s", NO_ANSWER, error_text(errno));
        return failed(f, 0, "recv: %s", errno == ETIMEDOUT ? "timed out" : error_text(errno));
    }
    if (got < 13) return failed(f, 0, "%s", got ? "the agent's answer was cut short" : NO_ANSWER);
    if (memcmp(head.data, "IPWARDA\x02", 8) != 0)
        return failed(f, 0, "the answer is not ipward wire protocol 2 (another program there?)");
    uint32_t length = big_endian((const unsigned char *)head.data + 9);
    if (length > MAX_ANSWER)
        return failed(f, 0, "an answer of %u bytes (the limit is %d)", length, MAX_ANSWER);
    if (receive(fd, out, length, &got, deadline) != 0) {
        if (errno == ECONNRESET) return failed(f, 0, "%s: %s", NO_ANSWER, error_text(errno));
        return failed(f, 0, "recv: %s", errno == ETIMEDOUT ? "timed out" : error_text(errno));
    }
    if (got < length) return failed(f, 0, "the agent's answer was cut short");
    return (unsigned char)head.data[8];
}

#ifndef IPWARD_FUZZ
static int connect_agent(int fd, const char *path, long long deadline) {
    /* A blocking connect waits while the listen backlog is full, up to SO_SNDTIMEO
     * (then EAGAIN), where a non-blocking one would fail at once. */
    long long left = deadline - now_ms();
    struct timeval wait = {.tv_sec = left / 1000, .tv_usec = left % 1000 * 1000};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &wait, sizeof wait);
    struct sockaddr_un address = {.sun_family = AF_UNIX};
    memcpy(address.sun_path, path, strlen(path));
    while (connect(fd, (struct sockaddr *)&address, sizeof address) != 0)
        if (errno != EINTR) return -1;
    return fcntl(fd, F_SETFL, O_NONBLOCK);
}
#else
/* Fuzzing exercises everything but the socket: no agent ever answers. */
static int connect_agent(int fd, const char *path, long long deadline) {
    (void)fd, (void)path, (void)deadline;
    errno = ECONNREFUSED;
    return -1;
}
#endif

/* Send the call to the agent at `path`: its exit status with its stdout in c->out, or
 * -1 with `f` saying why no answer came. An ADD's note is written once the agent is
 * trusted, before a byte is sent. */
static int forward(struct call *c, const char *path, const char *note, struct failure *f) {
    long long deadline = now_ms() + CALL_TIMEOUT_MS;
    struct buf request = {0};
    if (encode_request(c, &request, f) != 0) return -1;
    uid_t me = geteuid();
    struct stat st;
    if (stat(path, &st) != 0) return failed_call(f, "stat", errno);
    if (!S_ISSOCK(st.st_mode)) return failed(f, 1, "%s is not a socket", path);
    if (st.st_uid != 0 && st.st_uid != me)
        return failed(f, 1, "%s is owned by uid %u; the plugin talks only to a socket of root"
                      " or of its own uid %u", path, (unsigned)st.st_uid, (unsigned)me);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return failed_call(f, "socket", errno);
    int status = -1;
    struct ucred peer;
    socklen_t size = sizeof peer;
    if (connect_agent(fd, path, deadline) != 0) failed_call(f, "connect", errno);
    else if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &size) != 0)
        failed_call(f, "SO_PEERCRED", errno);
    else if (peer.uid != 0 && peer.uid != me)
        failed(f, 1, "the process listening on %s (pid %d) runs as uid %u; the plugin talks"
               " only to an agent of root or of its own uid %u", path, (int)peer.pid,
               (unsigned)peer.uid, (unsigned)me);
    else if (note && is_command(c, "ADD") && write_note(note, path) != 0) {
        int e = errno;
        struct buf shown = {0};
        put_replacing(&shown, (const unsigned char *)note, strlen(note));
        f->note = 1;
        failed(f, 0, "cannot write its note %s: %s", text(&shown), error_text(e));
    } else {
        int sending = 1;
        for (size_t at = 0; sending && at < request.len;) {
            ssize_t n = send(fd, request.data + at, request.len - at, MSG_NOSIGNAL);
            if (n >= 0) at += (size_t)n;
            else if (errno == EPIPE || errno == ECONNRESET)
                sending = 0; /* it answered without reading all of it: read that */
            else if (errno == EINTR) continue;
            else if (errno != EAGAIN || wait_for(fd, POLLOUT, deadline) != 0) {
                failed(f, 0, "send: %s", errno == ETIMEDOUT ? "timed out" : error_text(errno));
                sending = -1;
            }
        }
        if (sending >= 0) status = read_answer(fd, &c->out, deadline, f);
    }
    close(fd);
    return status;
}

/* The error object when no answer came (never success: nothing was done). */
static int unreachable(struct call *c, const char *path, struct failure *f) {
    struct buf msg = {0};
    const char *reason = text(&f->reason);
    if (is_command(c, "STATUS")) {
        putf(&msg, "cannot serve ADD: ipward agent at %s: %s", path, reason);
        return error_answer(c, NOT_AVAILABLE, text(&msg));
    }
    if (f->note) {
        putf(&msg, "ADD not sent to the ipward agent at %s: %s", path, reason);
        return error_answer(c, TRY_AGAIN, text(&msg));
    }
    if (f->refused) {
        putf(&msg, "ipward agent at %s not usable (%s); nothing was sent", path, reason);
        return error_answer(c, IO_FAILURE, text(&msg));
    }
    putf(&msg, "ipward agent at %s unreachable (%s); %s", path, reason,
         is_command(c, "DEL") ? "nothing was freed; retry the DEL" : "try again later");
    return error_answer(c, TRY_AGAIN, text(&msg));
}

/* Forward the call and answer with what the agent says, or why it said nothing. */
static int send_call(struct call *c, const char *path) {
    const char *note = is_command(c, "ADD") || is_command(c, "DEL") ? note_path(c) : NULL;
    struct failure f = {0};
    int status = forward(c, path, note, &f);
    if (status < 0) {
        if (is_command(c, "DEL") && !held(note)) {
            c->out.len = 0;
            return OK_STATUS; /* no ADD of it reached an agent: nothing is held */
        }
        return unreachable(c, path, &f);
    }
    if (is_command(c, "DEL") && status == 0) remove_note(note);
    return status;
}

/* -- what is answered here (no agent to forward to) ------------------------------------- */

static int version_answer(struct call *c) {
    const struct value *asked = member(c->config, "cniVersion");
    c->out.len = 0;
    puts_(&c->out, "{\"cniVersion\":");
    if (asked) put_json(&c->out, asked);
    else puts_(&c->out, "\"1.1.0\"");
    puts_(&c->out, ",\"supportedVersions\":[");
    for (size_t i = 0; i < COUNT(SUPPORTED); i++) putf(&c->out, "%s\"%s\"", i ? "," : "", SUPPORTED[i]);
    puts_(&c->out, "]}\n");
    return OK_STATUS;
}

static int answer_here(struct call *c, const char *why, size_t where) {
    struct buf msg = {0};
    if (c->stdin_len > MAX_CONFIG) {
        putf(&msg, "network configuration on stdin is larger than the limit of %d bytes", MAX_CONFIG);
        return error_answer(c, TOO_LARGE, text(&msg));
    }
    int blank_stdin = 1; /* bytes.strip(): ASCII whitespace */
    for (size_t i = 0; i < c->stdin_len && blank_stdin; i++)
        blank_stdin = strchr(" \t\n\r\v\f", c->stdin_[i]) && c->stdin_[i];
    if (!c->config && !blank_stdin) {
        putf(&msg, "network configuration on stdin is not JSON: %s (byte %zu)", why, where);
        return error_answer(c, DECODE_FAILURE, text(&msg));
    }
    if (is_command(c, "VERSION")) return version_answer(c);
    if (!c->config) return error_answer(c, DECODE_FAILURE, "no network configuration on stdin");
    const struct value *ipam = member(c->config, "ipam");
    if (!ipam || ipam->kind != J_OBJECT) {
        putf(&msg, "the 'ipam' section is missing or not an object; %s", NO_IN_PROCESS);
        return error_answer(c, INVALID_CONFIG, text(&msg));
    }
    static const char *const fields[] = {"agentSocket", "agent_socket"};
    for (size_t i = 0; i < COUNT(fields); i++) {
        const struct value *field = member(ipam, fields[i]);
        const char *problem = field ? socket_path_problem(field) : NULL;
        if (problem) {
            putf(&msg, "ipam.%s %s; %s", fields[i], problem, NO_IN_PROCESS);
            return error_answer(c, INVALID_CONFIG, text(&msg));
        }
    }
    putf(&msg, "ipam.agentSocket is missing%s; %s",
         member(ipam, "store") ? " (ipam.store is ignored)" : "", NO_IN_PROCESS);
    return error_answer(c, INVALID_CONFIG, text(&msg));
}

/* The whole call: its exit status, with what to print in c->out. */
static int plugin(struct call *c) {
    const char *why = NULL;
    size_t where = 0;
    c->config = c->stdin_len <= MAX_CONFIG ? parse_json(c->stdin_, c->stdin_len, &why, &where) : NULL;
    const char *path = !is_command(c, "VERSION") ? agent_socket(c->config) : NULL;
    if (path) return send_call(c, path);
    if (is_command(c, "DEL") && !held(note_path(c))) return OK_STATUS;
    return answer_here(c, why, where);
}

#ifndef IPWARD_FUZZ
int main(void) {
    static unsigned char input[MAX_CONFIG + 1]; /* one byte past the limit: enough to refuse */
    signal(SIGPIPE, SIG_IGN);
    size_t len = 0;
    while (len < sizeof input) {
        ssize_t n = read(0, input + len, sizeof input - len);
        if (n == 0) break;
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { len = 0; break; } /* no stdin: as none */
        len += (size_t)n;
    }
    struct call c = {.stdin_ = input, .stdin_len = len, .command = getenv("CNI_COMMAND")};
    int status = plugin(&c);
    for (size_t at = 0; at < c.out.len;) {
        ssize_t n = write(1, c.out.data + at, c.out.len - at);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        at += (size_t)n;
    }
    free_all();
    return status;
}
#endif
