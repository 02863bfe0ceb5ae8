/*
 * libFuzzer target for the native plugin's parsing of what it does not control: the
 * network configuration on stdin, its CNI_* environment and the agent's answer
 * (tests/system/test_native_plugin.py builds it with ASan and UBSan and runs it).
 *
 * The first byte chooses: with its top bit set, the rest is an agent's answer, read
 * from a socket pair as from the agent; else its low bits choose CNI_COMMAND, and the
 * rest is CNI_CONTAINERID, NUL, CNI_IFNAME, NUL, then stdin, and the whole call runs
 * (built with IPWARD_FUZZ, no agent is ever reached: connecting fails).
 */
#include "ipward-cni.c"

static const char *const COMMANDS[] = {"ADD", "DEL", "CHECK", "GC", "STATUS", "VERSION", "", NULL};

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    setenv("IPWARD_CNI_NOTES", "/nonexistent/ipward-fuzz-notes", 1); /* held() finds none */
    return 0;
}

/* The bytes up to the next NUL (or the end) as a C string; `at` moves past them. */
static char *take_string(const uint8_t *data, size_t size, size_t *at) {
    size_t start = *at;
    while (*at < size && data[*at]) (*at)++;
    char *s = allocate(*at - start + 1);
    memcpy(s, data + start, *at - start);
    s[*at - start] = 0;
    if (*at < size) (*at)++;
    return s;
}

static void answer(const uint8_t *data, size_t size) {
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, pair) != 0) abort();
    for (size_t at = 0; at < size;) {
        ssize_t n = write(pair[1], data + at, size - at);
        if (n <= 0) abort(); /* the fuzzer's -max_len keeps inputs within the buffer */
        at += (size_t)n;
    }
    close(pair[1]);
    fcntl(pair[0], F_SETFL, O_NONBLOCK);
    struct buf out = {0};
    struct failure f = {0};
    read_answer(pair[0], &out, now_ms() + 1000, &f);
    close(pair[0]);
}

static void call(unsigned char mode, const uint8_t *data, size_t size) {
    const char *command = COMMANDS[mode % (sizeof COMMANDS / sizeof *COMMANDS)];
    size_t at = 0;
    char *container = take_string(data, size, &at);
    char *ifname = take_string(data, size, &at);
    setenv("CNI_CONTAINERID", container, 1);
    setenv("CNI_IFNAME", ifname, 1);
    struct call c = {.stdin_ = data + at, .stdin_len = size - at, .command = command};
    plugin(&c);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    if (data[0] & 0x80) answer(data + 1, size - 1);
    else call(data[0], data + 1, size - 1);
    free_all();
    return 0;
}
