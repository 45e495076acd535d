/*
 * A proposal, not the spec: the lease held per link, and block epochs as seqlocks
 * (docs/proposals/lease-per-link.md). Hand-written, because what it checks is an ordering
 * of memory reads and writes, which the transition tables do not express; once the
 * proposal is taken, its rows go into spec/ and this file gives way to generated models.
 *
 * One exporter serves one bank (one block of it: blocks are independent) to NI importer
 * processes. Each importer leases the bank once for its link (one round trip), maps it,
 * and then imports for as long as it likes without asking the exporter: each import reads
 * the block at the epoch the decode index named, as a seqlock reader. Its renewal thread
 * learns when a renewal is refused (the lease expired, or the bank drains); from then on
 * it imports nothing more, unmaps and returns the lease. It may also close the link
 * (unmapping first, as the importer's rule says) or die (the kernel unmaps a dead process
 * before its socket hangs up) between imports. Two storer processes each store into the
 * block: it is reserved by one store at a time, its epoch goes odd before the first byte
 * changes and even once the store has ended. The exporter grants, expires (an importer
 * whose renewal came too late), drains and frees.
 *
 * Checked (tests/test_proposals.py, with each PLANT_ below as a bug that must be caught):
 *   memory:   the bank is freed only with no mapping left and no store writing it, and
 *             nobody reads or writes it freed;
 *   content:  a block an import accepts holds, untorn, the version the index named;
 *   liveness: (ltl drain_frees, weak fairness) a drained bank is freed, although each
 *             importer would import forever.
 */

#define NI 2  /* importers: the exporter's rows below name both links */

#define LIVE 0
#define DRAINING 1
#define FREED 2

#define NONE 0
#define HELD 1
#define EXPIRED 2

byte bank = LIVE;
byte lease[NI];      /* the exporter's lease table: one lease per link */
bool mapped[NI];     /* importer i maps the bank */
bool refused[NI];    /* importer i's renewal thread saw a renewal refused */
/* One block of the bank: blocks are independent (each has its epoch and its reservation). */
byte epoch;          /* even: stable; odd: a store is writing the block */
bool writing;        /* the block is reserved by a store (until it ended) */
byte storing;        /* stores begun and not ended */
byte half1;          /* the block's bytes, as two halves: a store writes version k into */
byte half2;          /* both, so a read between them is torn */

chan request = [NI] of { byte };
chan answer[NI] = [1] of { bool };
chan returned = [NI] of { byte };   /* a lease returned after unmapping */
chan hangup = [NI] of { byte };     /* a link closed: by death, or by its importer */

inline reads_bank(i) {
    assert(mapped[i] && bank != FREED)
}

proctype Storer() {
    if
    :: atomic {
        bank == LIVE &&
#ifndef PLANT_TWO_STORES_ONE_BLOCK
        !writing &&
#endif
        true -> writing = true; storing++ }
    :: bank != LIVE -> goto declined  /* a draining bank takes no store */
    fi;
#ifndef PLANT_EPOCH_AFTER_THE_BYTES
    epoch = epoch + 1;
#endif
    assert(bank != FREED); half1 = half1 + 1;
    assert(bank != FREED); half2 = half2 + 1;
#ifndef PLANT_EPOCH_AFTER_THE_BYTES
    epoch = epoch + 1;
#else
    epoch = epoch + 2;
#endif
    atomic { writing = false; storing-- };
declined:
    skip
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
    byte i;
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
    :: atomic { lease[0] == HELD -> expire(0) }
    :: atomic { lease[1] == HELD -> expire(1) }
    :: bank == LIVE -> bank = DRAINING
    :: atomic { bank == DRAINING && lease[0] == NONE && lease[1] == NONE && storing == 0 ->
        assert(!mapped[0] && !mapped[1]);
        bank = FREED }
    od
}

/* The importer's native renewal thread: a refused renewal (the lease expired, or the bank
 * drains and takes no renewal) is the importer's only word that the bank is going. */
proctype Renewer(byte i) {
end:
    atomic { (lease[i] == EXPIRED || bank != LIVE) -> refused[i] = true }
}

proctype Importer(byte i) {
    byte want, e1, e2, c1, c2;
    bool granted, shut;

    request!i;  /* the link's one round trip */
    answer[i]?granted;
    if
    :: granted -> mapped[i] = true
    :: else -> goto gone
    fi;
    do
#ifndef PLANT_REFUSAL_IGNORED
    :: !refused[i] ->
#else
    :: true ->
#endif
        /* the index answers: the block, stored at epoch want (stale by the copy, maybe) */
        want = epoch;
        if
#ifndef PLANT_ODD_EPOCH_TRUSTED
        :: want % 2 == 0 ->
#else
        :: true ->
#endif
            e1 = epoch;
            if
            :: e1 == want ->
                reads_bank(i); c1 = half1;
                reads_bank(i); c2 = half2;
#ifndef PLANT_NO_SECOND_EPOCH_READ
                e2 = epoch;
#else
                e2 = e1;
#endif
                if
                :: e2 == e1 -> assert(c1 == want / 2 && c2 == want / 2)
                :: else -> skip  /* a store overlapped the copy: this block is a miss */
                fi
            :: else -> skip      /* rewritten since the index answered: a miss */
            fi
        :: else -> skip          /* odd: a store is writing it; refused, whoever named it */
        fi;
        d_step { want = 0; e1 = 0; e2 = 0; c1 = 0; c2 = 0 }  /* merge states */
    :: refused[i] -> break
    :: break                     /* the importer is done with this bank */
    :: !shut ->                  /* the importer closes the link (its own rule: unmap first) */
#ifndef PLANT_LINK_SHUT_WHILE_MAPPED
        mapped[i] = false;
        hangup!i;
        goto gone
#else
        hangup!i;
        shut = true
#endif
    :: mapped[i] = false;        /* death: the kernel unmaps, then the socket hangs up */
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
        run Renewer(0);
        run Renewer(1);
        run Importer(0);
        run Importer(1);
        run Storer();
        run Storer()
    }
}

ltl drain_frees { [] ((bank == DRAINING) -> <> (bank == FREED)) }
