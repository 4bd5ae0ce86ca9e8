"""The coins: Philox-4x32-10 against the Random123 known-answer vectors, and its uniforms."""

from rheo_engine.spec import reference


def test_philox_known_answers():
    # Random123 kat_vectors: philox4x32_10, counter and key all zeros / all ones.
    zeros = reference.philox4x32_10((0, 0, 0, 0), (0, 0))
    assert zeros == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = reference.philox4x32_10((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2)
    assert ones == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def test_uniforms_are_in_range_and_keyed():
    coins = {
        reference.philox_uniform(7, step, 3, index) for step in range(50) for index in range(50)
    }
    assert len(coins) == 2500 and all(0.0 <= u < 1.0 for u in coins)
    assert reference.pool_coin(1, 2, 3, 4) != reference.pool_coin(2, 2, 3, 4)
    assert reference.verify_coin(1, 2, 0, 5, 1, 0) != reference.verify_coin(1, 2, 0, 5, 1, 1)
