/*
 * A proposal, not the spec: the lease held per link, and block epochs as seqlocks
 * (docs/proposals/lease-per-link.md). Hand-written, because what it checks is an ordering
 * of memory reads and writes, which the transition tables do not express; once the
 * proposal is taken, its rows go into spec/ and this file gives way to generated models.
 *
 * One exporter serves one bank of NB blocks to NI importer processes. Each importer leases
 * the bank once for its link (one round trip), maps it, and then makes IMPORTS imports
 * without asking the exporter: each import reads one block that the decode index named at
 * an epoch, as a seqlock reader. The exporter stores into blocks at any time (an epoch
 * goes odd before the bytes change and even after), expires leases (an importer whose
 * renewal came too late), drains and frees the bank. Importers may crash at any point
 * between imports; the kernel unmaps a dead process before its socket hangs up.
 *
 * Checked (tests/test_proposals.py, with each PLANT_ below as a bug that must be caught):
 *   memory:  no importer reads the bank unmapped or freed, and the bank is freed only
 *            with no mapping left (the lease rule, unchanged: INV-RELEASE-QUIESCENT);
 *   content: a block an import accepts holds, untorn, the version the index named;
 *   liveness (ltl drain_frees, weak fairness): a drained bank is freed.
 */

#define NI 2  /* the exporter's rows below name both links */
#define NB 2
#define REWRITES 2
#define IMPORTS 2

#define LIVE 0
#define DRAINING 1
#define FREED 2

#define NONE 0
#define HELD 1
#define EXPIRED 2

byte bank = LIVE;
byte lease[NI];      /* the exporter's lease table: one lease per link */
bool mapped[NI];     /* importer i maps the bank */
byte epoch[NB];      /* even: stable; odd: a store is writing the block */
byte half1[NB];      /* a block's bytes, as two halves: a store writes version k into */
byte half2[NB];      /* both, so a read between them is torn */

chan request = [NI] of { byte };
chan answer[NI] = [1] of { bool };
chan returned = [NI] of { byte };   /* a lease returned after unmapping */
chan hangup = [NI] of { byte };     /* a link closed by the process's death */

inline reads_bank(i) {
    assert(mapped[i] && bank != FREED)
}

inline store(b) {
#ifndef PLANT_EPOCH_AFTER_THE_BYTES
    epoch[b] = epoch[b] + 1;
#endif
    half1[b] = half1[b] + 1;
    half2[b] = half2[b] + 1;
#ifndef PLANT_EPOCH_AFTER_THE_BYTES
    epoch[b] = epoch[b] + 1
#else
    epoch[b] = epoch[b] + 2
#endif
}

inline expire(i) {
    /* bank.toml's lease_expired rows: the bank drains, the lease stays until returned */
#ifndef PLANT_EXPIRY_DROPS_THE_LEASE
    lease[i] = EXPIRED;
#else
    lease[i] = NONE;
#endif
    if
    :: bank == LIVE -> bank = DRAINING
    :: else -> skip
    fi
}

proctype Exporter() {
    byte i, b, stores = 0;
end:
    do
    :: request?i ->
        if
        :: bank == LIVE && lease[i] == NONE -> lease[i] = HELD; answer[i]!true
        :: else -> answer[i]!false
        fi;
        i = 0
    :: returned?i -> lease[i] = NONE; i = 0
    :: hangup?i -> lease[i] = NONE; i = 0
    :: bank == LIVE && stores < REWRITES ->
        if
        :: b = 0
        :: b = 1
        fi;
        store(b);
        d_step { stores++; b = 0 }
    :: atomic { lease[0] == HELD -> expire(0) }
    :: atomic { lease[1] == HELD -> expire(1) }
    :: bank == LIVE -> bank = DRAINING
    :: atomic { bank == DRAINING && lease[0] == NONE && lease[1] == NONE ->
        assert(!mapped[0] && !mapped[1]);
        bank = FREED }
    od
}

proctype Importer(byte i) {
    byte n = 0, b, want, e1, e2, c1, c2;
    bool granted;

    request!i;  /* the link's one round trip */
    answer[i]?granted;
    if
    :: granted -> mapped[i] = true
    :: else -> goto gone
    fi;
    do
    :: n < IMPORTS ->
        /* the index answers: block b, stored at epoch want (stale by the copy, maybe) */
        if
        :: b = 0
        :: b = 1
        fi;
        want = epoch[b];
        if
#ifndef PLANT_ODD_EPOCH_TRUSTED
        :: want % 2 == 0 ->
#else
        :: true ->
#endif
            e1 = epoch[b];
            if
            :: e1 == want ->
                reads_bank(i); c1 = half1[b];
                reads_bank(i); c2 = half2[b];
#ifndef PLANT_NO_SECOND_EPOCH_READ
                e2 = epoch[b];
#else
                e2 = e1;
#endif
                if
                :: e2 == e1 ->
                    assert(c1 == want / 2 && c2 == want / 2)
                :: else -> skip  /* a store overlapped the copy: this block is a miss */
                fi
            :: else -> skip      /* rewritten since the index answered: a miss */
            fi
        :: else -> skip          /* odd: a store is writing it; refused, whoever named it */
        fi;
        d_step { n++; b = 0; want = 0; e1 = 0; e2 = 0; c1 = 0; c2 = 0 }  /* merge states */
    :: lease[i] == EXPIRED || bank != LIVE -> break  /* a renewal was refused */
    :: n == IMPORTS -> break
    :: true ->
        mapped[i] = false;       /* death: the kernel unmaps, then the socket hangs up */
        hangup!i;
        goto gone
    od;
#if defined(PLANT_LEASE_NEVER_RETURNED)
    mapped[i] = false;
#elif !defined(PLANT_RETURN_BEFORE_UNMAP)
    mapped[i] = false;
    returned!i;
#else
    returned!i;
    mapped[i] = false;
#endif
gone:
    skip
}

init {
    atomic {
        run Exporter();
        run Importer(0);
        run Importer(1)
    }
}

ltl drain_frees { [] ((bank == DRAINING) -> <> (bank == FREED)) }
