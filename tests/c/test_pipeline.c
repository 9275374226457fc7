/* Pipelines: the 1F1B schedule's timing (hexiseq_pipeline_schedule) on cases worked out by hand, against the closed
 * form for equal stages, and against its own invariants on random ones; the layers' split over stages
 * (hexiseq_pipeline_split) against hand-worked cases and brute force; bad inputs fail naming the field. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "hexiseq.h"

#include "check.h"

static int near(double a, double b) { return fabs(a - b) <= 1e-9 * (1.0 + fabs(b)); }

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static double urand(void) {
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (double)((rng_state * 0x2545F4914F6CDD1Dull) >> 11) / 9007199254740992.0;
}

static hexiseq_status run(int32_t P, int32_t M, const double *f, const double *b, const double *send, double *idle,
                          int32_t *in_flight, hexiseq_pipeline_timing *t) {
    hexiseq_pipeline p = {P, M, f, b, send};
    return hexiseq_pipeline_schedule(&p, idle, in_flight, t);
}

static void test_schedule_by_hand(void) {
    hexiseq_pipeline_timing t;
    double idle[8];
    int32_t in[8];
    /* one stage: its micro-batches one after another, nothing idle */
    double f1[] = {1.0}, b1[] = {2.0};
    EXPECT(run(1, 3, f1, b1, NULL, idle, in, &t) == HEXISEQ_OK, "one stage: %s", hexiseq_last_error());
    EXPECT(near(t.step_s, 9.0) && near(t.bubble_s, 0.0) && in[0] == 1, "one stage: step %g bubble %g in %d", t.step_s,
           t.bubble_s, in[0]);
    /* equal stages: (M + P - 1)(f + b), the bubble (P - 1)(f + b), stage s holds min(P - s, M) micro-batches */
    double f4[] = {1, 1, 1, 1}, b4[] = {2, 2, 2, 2};
    EXPECT(run(4, 8, f4, b4, NULL, idle, in, &t) == HEXISEQ_OK, "equal stages");
    EXPECT(near(t.step_s, 33.0) && near(t.work_s, 24.0) && near(t.bubble_s, 9.0), "equal: step %g work %g bubble %g",
           t.step_s, t.work_s, t.bubble_s);
    EXPECT(in[0] == 4 && in[1] == 3 && in[2] == 2 && in[3] == 1, "equal: in flight %d %d %d %d", in[0], in[1], in[2],
           in[3]);
    EXPECT(near(idle[0], 9.0) && near(idle[3], 9.0), "equal: idle %g %g", idle[0], idle[3]);
    EXPECT(run(4, 2, f4, b4, NULL, idle, in, &t) == HEXISEQ_OK && in[0] == 2 && in[1] == 2 && in[2] == 2 && in[3] == 1,
           "fewer micro-batches than stages: in flight %d %d %d %d", in[0], in[1], in[2], in[3]);
    EXPECT(near(t.step_s, 15.0), "P 4, M 2: (M + P - 1)(f + b) = 15, got %g", t.step_s);
    /* a send each way: F0 0-1 on stage 0, 1.5-2.5 on stage 1, B0 2.5-4.5 there, 5.0-7.0 on stage 0 */
    double f2[] = {1, 1}, b2[] = {2, 2}, s2[] = {0.5};
    EXPECT(run(2, 1, f2, b2, s2, idle, in, &t) == HEXISEQ_OK && near(t.step_s, 7.0), "send: step %g", t.step_s);
    /* unequal stages, worked by hand: stage 0 (f 1, b 2) runs F0 0-1, F1 1-2, B0 7-9, B1 13-15; stage 1 (f 2, b 4)
     * runs F0 1-3, B0 3-7, F1 7-9, B1 9-13: the step is 15, stage 1 the bottleneck with 12 of work */
    double fu[] = {1, 2}, bu[] = {2, 4};
    EXPECT(run(2, 2, fu, bu, NULL, idle, in, &t) == HEXISEQ_OK, "unequal");
    EXPECT(near(t.step_s, 15.0) && t.bottleneck == 1 && near(t.work_s, 12.0) && near(t.bubble_s, 3.0),
           "unequal: step %g bottleneck %d work %g bubble %g", t.step_s, t.bottleneck, t.work_s, t.bubble_s);
    EXPECT(near(idle[0], 9.0) && near(idle[1], 3.0), "unequal: idle %g %g", idle[0], idle[1]);
}

static void test_schedule_invariants(void) {
    /* random stages: the step is at least the busiest stage's work and at least one micro-batch's trip through
     * every stage and send; equal stages meet the closed form; NULL outputs are allowed */
    for (int trial = 0; trial < 300; ++trial) {
        int32_t P = 1 + (int32_t)(urand() * 8), M = 1 + (int32_t)(urand() * 12);
        double f[8], b[8], s[8], trip = 0.0, work = 0.0;
        for (int32_t i = 0; i < P; ++i) {
            f[i] = 0.1 + urand();
            b[i] = f[i] * (1.5 + urand());
            s[i] = urand() * 0.3;
            trip += f[i] + b[i];
            work = fmax(work, M * (f[i] + b[i]));
        }
        for (int32_t i = 0; i + 1 < P; ++i)
            trip += 2 * s[i];
        hexiseq_pipeline_timing t;
        EXPECT(run(P, M, f, b, s, NULL, NULL, &t) == HEXISEQ_OK, "random %d: %s", trial, hexiseq_last_error());
        EXPECT(t.step_s >= work * (1 - 1e-12) && t.step_s >= trip * (1 - 1e-12) && near(t.bubble_s, t.step_s - t.work_s),
               "random %d: step %g work %g trip %g", trial, t.step_s, work, trip);
        double fe[8], be[8];
        for (int32_t i = 0; i < P; ++i)
            fe[i] = f[0], be[i] = b[0];
        EXPECT(run(P, M, fe, be, NULL, NULL, NULL, &t) == HEXISEQ_OK &&
                   near(t.step_s, (M + P - 1) * (f[0] + b[0])),
               "equal %d: P %d M %d step %g", trial, (int)P, (int)M, t.step_s);
    }
    /* a large pipeline stays cheap and exact: 128 stages, 1,024 micro-batches */
    static double f[128], b[128];
    for (int i = 0; i < 128; ++i)
        f[i] = 1.0, b[i] = 2.0;
    hexiseq_pipeline_timing t;
    EXPECT(run(128, 1024, f, b, NULL, NULL, NULL, &t) == HEXISEQ_OK && near(t.step_s, (1024 + 127) * 3.0),
           "128 x 1024: step %g", t.step_s);
}

static void test_schedule_errors(void) {
    hexiseq_pipeline_timing t;
    double f[] = {1, 1}, b[] = {2, 2}, bad[] = {1, NAN}, neg[] = {-1.0};
    EXPECT(hexiseq_pipeline_schedule(NULL, NULL, NULL, &t) == HEXISEQ_ERR_NULL, "NULL pipeline");
    EXPECT(run(0, 1, f, b, NULL, NULL, NULL, &t) == HEXISEQ_ERR_INVALID && strstr(hexiseq_last_error(), "n_stages"),
           "P 0: %s", hexiseq_last_error());
    EXPECT(run(2, 0, f, b, NULL, NULL, NULL, &t) == HEXISEQ_ERR_INVALID &&
               strstr(hexiseq_last_error(), "micro_batches must be in [1, 1048576], got 0"),
           "M 0: %s", hexiseq_last_error());
    EXPECT(run(2, 1, bad, b, NULL, NULL, NULL, &t) == HEXISEQ_ERR_INVALID &&
               strstr(hexiseq_last_error(), "forward_s[1] must be a finite time >= 0, got nan"),
           "NaN: %s", hexiseq_last_error());
    EXPECT(run(2, 1, f, b, neg, NULL, NULL, &t) == HEXISEQ_ERR_INVALID && strstr(hexiseq_last_error(), "send_s[0]"),
           "negative send: %s", hexiseq_last_error());
    EXPECT(run(2, 1, NULL, b, NULL, NULL, NULL, &t) == HEXISEQ_ERR_NULL, "NULL forward_s");
}

/* brute force: every split of L layers over P stages (each >= 1, within its cap), the smallest slowest stage */
static double best_split(int32_t P, int32_t L, const double *fixed, const double *per, const int32_t *cap, int32_t s) {
    if (s == P - 1) {
        if (L < 1 || (cap && L > cap[s]))
            return INFINITY;
        return fixed[s] + L * per[s];
    }
    double best = INFINITY;
    for (int32_t k = 1; k <= L - (P - 1 - s); ++k) {
        if (cap && k > cap[s])
            break;
        double here = fixed[s] + k * per[s], rest = best_split(P, L - k, fixed, per, cap, s + 1);
        best = fmin(best, fmax(here, rest));
    }
    return best;
}

static void test_split(void) {
    int32_t out[8];
    double max;
    double zero4[] = {0, 0, 0, 0}, one4[] = {1, 1, 1, 1};
    EXPECT(hexiseq_pipeline_split(4, 32, zero4, one4, NULL, out, &max) == HEXISEQ_OK && out[0] == 8 && out[3] == 8 &&
               near(max, 8.0),
           "equal: %d %d max %g", out[0], out[3], max);
    /* a stage twice as slow per layer takes half the layers: max(n0, 2 n1) over n0 + n1 = 9 is 6 at (6, 3) */
    double z2[] = {0, 0}, per2[] = {1, 2};
    EXPECT(hexiseq_pipeline_split(2, 9, z2, per2, NULL, out, &max) == HEXISEQ_OK && out[0] == 6 && out[1] == 3 &&
               near(max, 6.0),
           "unequal: %d %d max %g", out[0], out[1], max);
    /* the embedding and the head as fixed parts: max(5 + a, b, 3 + c), a + b + c = 12, is 7; under 7, 13 layers fit,
     * and the one too many comes off the first of the slowest stages */
    double fx[] = {5, 0, 3}, p3[] = {1, 1, 1};
    EXPECT(hexiseq_pipeline_split(3, 12, fx, p3, NULL, out, &max) == HEXISEQ_OK && out[0] == 1 && out[1] == 7 &&
               out[2] == 4 && near(max, 7.0),
           "fixed: %d %d %d max %g", out[0], out[1], out[2], max);
    /* memory caps */
    int32_t caps[] = {2, 10};
    double one2[] = {1, 1};
    EXPECT(hexiseq_pipeline_split(2, 10, z2, one2, caps, out, &max) == HEXISEQ_OK && out[0] == 2 && out[1] == 8,
           "caps: %d %d", out[0], out[1]);
    int32_t tight[] = {2, 3};
    EXPECT(hexiseq_pipeline_split(2, 10, z2, one2, tight, out, &max) == HEXISEQ_ERR_MEMORY &&
               strstr(hexiseq_last_error(), "at most 5 layers") && strstr(hexiseq_last_error(), "the model has 10"),
           "too tight: %s", hexiseq_last_error());
    EXPECT(hexiseq_pipeline_split(4, 3, zero4, one4, NULL, out, &max) == HEXISEQ_ERR_INVALID &&
               strstr(hexiseq_last_error(), "layers must be >= n_stages (4"),
           "L < P: %s", hexiseq_last_error());
    double nan2[] = {0, NAN};
    EXPECT(hexiseq_pipeline_split(2, 4, z2, nan2, NULL, out, &max) == HEXISEQ_ERR_INVALID &&
               strstr(hexiseq_last_error(), "layer_s[1]"),
           "NaN: %s", hexiseq_last_error());
    int32_t zero_cap[] = {0, 4};
    EXPECT(hexiseq_pipeline_split(2, 4, z2, one2, zero_cap, out, &max) == HEXISEQ_ERR_INVALID &&
               strstr(hexiseq_last_error(), "most_layers[0] must be >= 1, got 0"),
           "cap 0: %s", hexiseq_last_error());
    EXPECT(hexiseq_pipeline_split(2, 4, NULL, one2, NULL, out, &max) == HEXISEQ_ERR_NULL, "NULL fixed_s");
    /* against brute force on random stages, with and without caps */
    for (int trial = 0; trial < 400; ++trial) {
        int32_t P = 1 + (int32_t)(urand() * 4), L = P + (int32_t)(urand() * 10);
        double fixed[4], per[4];
        int32_t cap[4];
        for (int32_t s = 0; s < P; ++s) {
            fixed[s] = urand() < 0.5 ? 0.0 : urand() * 3;
            per[s] = urand() < 0.1 ? 0.0 : 0.2 + urand();
            cap[s] = 1 + (int32_t)(urand() * L);
        }
        const int32_t *caps_or = urand() < 0.5 ? cap : NULL;
        double want = best_split(P, L, fixed, per, caps_or, 0);
        hexiseq_status st = hexiseq_pipeline_split(P, L, fixed, per, caps_or, out, &max);
        if (!isfinite(want)) {
            EXPECT(st == HEXISEQ_ERR_MEMORY, "trial %d: no split fits, got status %d", trial, (int)st);
            continue;
        }
        EXPECT(st == HEXISEQ_OK && near(max, want), "trial %d: max %g, brute force %g (%s)", trial, max, want,
               hexiseq_last_error());
        int32_t total = 0;
        double slowest = 0.0;
        for (int32_t s = 0; s < P; ++s) {
            total += out[s];
            slowest = fmax(slowest, fixed[s] + out[s] * per[s]);
            EXPECT(out[s] >= 1 && (!caps_or || out[s] <= cap[s]), "trial %d: stage %d holds %d", trial, (int)s,
                   (int)out[s]);
        }
        EXPECT(total == L && near(slowest, max), "trial %d: %d layers, slowest %g vs %g", trial, (int)total, slowest,
               max);
    }
}

int main(void) {
    test_schedule_by_hand();
    test_schedule_invariants();
    test_schedule_errors();
    test_split();
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed ? 1 : 0;
}
